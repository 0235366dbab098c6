"""The mesh: world = pp x dp x Galaxy group, Galaxy ranks consecutive, then dp, then pp.

For every factorisation of world 4 each rank checks its coordinates and the members of its three
process groups against rank = (pp_index * dp + dp_index) * group_size + galaxy_rank; axes of size
1 have no process group. A run config's resolved plan gives the group size and shares.
"""
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from galaxy.config import GalaxyConfig, resolved_plan
from galaxy.distributed.mesh import global_rank, make_mesh, pipeline_ends_group
from galaxy.models.shape import read_model_shape
from galaxy.plan import Plan

FACTORINGS = [(1, 1, 4), (1, 4, 1), (4, 1, 1), (2, 2, 1), (2, 1, 2), (1, 2, 2)]


def _describe(pp, dp, size):
    mesh = make_mesh(Plan(pp=pp, dp=dp, heads=(4,) * size, columns=(8,) * size, tokens=(3,) * size))
    ranks = lambda pg: None if pg is None else dist.get_process_group_ranks(pg)  # noqa: E731
    return {"coords": (mesh.pp_rank, mesh.dp_rank, mesh.galaxy.rank), "galaxy": ranks(mesh.galaxy.pg),
            "dp": ranks(mesh.dp_pg), "pp": ranks(mesh.pp_pg), "first": mesh.is_first_stage,
            "last": mesh.is_last_stage}


@pytest.mark.parametrize("pp,dp,size", FACTORINGS, ids=[f"pp{p}-dp{d}-mp{g}" for p, d, g in FACTORINGS])
def test_rank_order(dist_pool, pp, dp, size):
    for rank, got in enumerate(dist_pool(4).run(_describe, pp, dp, size)):
        p, d, g = got["coords"]
        assert global_rank(p, d, g, dp, size) == rank
        assert got["galaxy"] == (None if size == 1 else [global_rank(p, d, i, dp, size) for i in range(size)])
        assert got["dp"] == (None if dp == 1 else [global_rank(p, i, g, dp, size) for i in range(dp)])
        assert got["pp"] == (None if pp == 1 else [global_rank(i, d, g, dp, size) for i in range(pp)])
        assert (got["first"], got["last"]) == (p == 0, p == pp - 1)


def test_a_placed_mesh(dist_pool):
    """mesh_rank_order [2, 0, 3, 1] (a pool joined through galaxy.launch.init_distributed): the
    process started as rank R holds position order.index(R) on pp 2 x group 2; groups hold positions."""
    order = (2, 0, 3, 1)
    placed = dist_pool(4, order).run(_describe, 2, 1, 2)
    assert [got["coords"] for got in placed] == [(0, 0, 1), (1, 0, 1), (0, 0, 0), (1, 0, 0)]
    for launch, got in enumerate(placed):
        p, d, g = got["coords"]
        assert global_rank(p, d, g, 1, 2) == order.index(launch)
        assert got["galaxy"] == [global_rank(p, 0, i, 1, 2) for i in range(2)]
        assert got["pp"] == [global_rank(i, 0, g, 1, 2) for i in range(2)]


def test_documented_example():
    """pp 2 x dp 2 x group 2: stage 1, replica 0, Galaxy rank 1 is rank 5."""
    assert global_rank(1, 0, 1, dp=2, group_size=2) == 5


def test_serial_mesh(dist_pool):
    got = dist_pool(1).run(_describe, 1, 1, 1)[0]
    assert got == {"coords": (0, 0, 0), "galaxy": None, "dp": None, "pp": None, "first": True, "last": True}


def _from_config(model_dir):
    cfg = GalaxyConfig(model_path=model_dir, pad_size=12, pp_deg=2, seq_scatter_list=[7, 5], pipeline_schedule="gpipe")
    mesh = make_mesh(resolved_plan(cfg, dist.get_world_size(), read_model_shape(cfg.model_path)))
    return mesh.pp_rank, mesh.galaxy.size, mesh.galaxy.tokens, mesh.galaxy.heads


def test_mesh_from_config(dist_pool, tiny_bert_dir):
    got = dist_pool(4).run(_from_config, tiny_bert_dir)
    assert got == [(0, 2, (7, 5), (3, 3)), (0, 2, (7, 5), (3, 3)), (1, 2, (7, 5), (3, 3)), (1, 2, (7, 5), (3, 3))]


def _stalled_partner(stall_s: float, timeout_s: float):
    """pp 2 x Galaxy 2: rank 0 all-reduces on its Galaxy group (with rank 1), then on its pp group
    (with rank 2); those partners join only after stall_s. Returns, per collective, (raised,
    seconds waited)."""
    mesh = make_mesh(Plan(pp=2, heads=(1, 1), columns=(1, 1), tokens=(1, 1)), timeout=timedelta(seconds=timeout_s))
    partner = {1: mesh.galaxy.pg, 2: mesh.pp_pg}
    rank, seen = dist.get_rank(), []
    groups = [mesh.galaxy.pg, mesh.pp_pg] if rank == 0 else [partner[rank]] if rank in partner else []
    if rank != 0:
        time.sleep(stall_s)
    for pg in groups:
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1), group=pg)
            seen.append((False, time.monotonic() - start))
        except RuntimeError:
            seen.append((True, time.monotonic() - start))
    return seen


def test_a_stalled_peer_stops_the_mesh_groups_within_the_timeout(dist_pool):
    """torch gives subgroups a 30-minute default; the mesh passes its timeout to every axis."""
    waited = dist_pool(4).run(_stalled_partner, 5.0, 1.0)[0]
    assert [raised for raised, _ in waited] == [True, True]
    assert all(seconds < 3.0 for _, seconds in waited), waited


def _ends_group_ranks(pp):
    pg = pipeline_ends_group(make_mesh(Plan(pp=pp, heads=(1,), columns=(1,), tokens=(1,))))
    return None if pg is None else dist.get_process_group_ranks(pg)


def test_pipeline_ends_group_pairs_the_first_and_last_stage(dist_pool):
    assert dist_pool(3).run(_ends_group_ranks, 3) == [[0, 2], None, [0, 2]]
    assert dist_pool(2).run(_ends_group_ranks, 2) == [[0, 1], [0, 1]]
