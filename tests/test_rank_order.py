"""mesh_rank_order: the process started as rank order[i] holds mesh position i, and a pipeline so
placed trains exactly like Hugging Face's serial model.

The pools here join the group through galaxy.launch.init_distributed, as an entry script does
(support.dist_pool, `order`), and report by launch rank. Each case is the pipeline parity case of
tests/test_pipeline.py (5 SGD steps, global batch 8 in 4 micro-batches, fp32, 1e-5 relative) with
the stages placed out of launch order; each launch rank's report names the layers its stage ran.
Per-device figures come back by launch rank; ranks started with different orders disagree before
any process group starts.
"""
import argparse

import pytest

from support.parity import check_report
from support.parity_runners import train_runner_and_compare
from support.tiny_models import TINY_SEQ, make_tiny_bert, tiny_batch

from galaxy.config import GalaxyConfig
from galaxy.distributed.agreement import compare, fingerprint
from galaxy.plan import Plan

SERIAL = ((6,), (96,), (TINY_SEQ,))          # tiny BERT: 6 heads, 96 columns, 12 tokens
UNEVEN_2 = ((4, 2), (64, 32), (7, 5))
GALAXY = Plan.preset("galaxy")


@pytest.fixture(scope="module")
def bert3_dir(tmp_path_factory):
    return make_tiny_bert(str(tmp_path_factory.mktemp("bert3")), num_hidden_layers=3)


def run_placed(pool, model_dir, shares, stages, schedule):
    reports = pool.run(train_runner_and_compare, "bert", model_dir, GALAXY, len(stages), 1, shares, tiny_batch,
                       {"num_microbatches": 4, "schedule": schedule, "stage_layers": stages})
    for launch_rank, report in enumerate(reports):
        check_report(report, launch_rank)
    return [r["stage"] for r in reports]


def test_pp2_reversed_matches_hf(dist_pool, bert3_dir):
    """[1, 0]: launch rank 1 holds stage 0 (layers 0-1), launch rank 0 stage 1 (layer 2)."""
    stages = run_placed(dist_pool(2, (1, 0)), bert3_dir, SERIAL, [2, 1], "1f1b")
    assert stages == [[2], [0, 1]]


def test_pp2_x_galaxy2_permuted_matches_hf(dist_pool, bert3_dir):
    """[2, 0, 3, 1] on pp 2 x Galaxy 2: positions 0, 1 (stage 0's Galaxy ranks 0, 1) are launch
    ranks 2 and 0; positions 2, 3 (stage 1) launch ranks 3 and 1 (uneven Galaxy shares)."""
    pool = dist_pool(4, (2, 0, 3, 1))
    stages = run_placed(pool, bert3_dir, UNEVEN_2, [1, 2], "gpipe")
    assert stages == [[0], [1, 2], [0], [1, 2]]
    # launch rank -> (group rank, stage, Galaxy rank, its Galaxy group's members, its pp group's)
    assert pool.run(_where) == [(1, 0, 1, [0, 1], [1, 3]), (3, 1, 1, [2, 3], [1, 3]),
                                (0, 0, 0, [0, 1], [0, 2]), (2, 1, 0, [2, 3], [0, 2])]


def _where():
    import torch.distributed as dist

    from galaxy.distributed.mesh import make_mesh
    mesh = make_mesh(Plan(pp=2, heads=UNEVEN_2[0], columns=UNEVEN_2[1], tokens=UNEVEN_2[2]))
    return (dist.get_rank(), mesh.pp_rank, mesh.galaxy.rank, dist.get_process_group_ranks(mesh.galaxy.pg),
            dist.get_process_group_ranks(mesh.pp_pg))


def test_per_device_figures_are_listed_by_launch_rank(dist_pool):
    """The summary's peak memory and generate.py's KV cache list the process started as rank R at
    index R (galaxy.distributed.per_device), where a plain all-gather lists mesh positions."""
    got = dist_pool(4, (2, 0, 3, 1)).run(_gathered)
    assert got == [(["device 0", "device 1", "device 2", "device 3"],
                    ["device 2", "device 0", "device 3", "device 1"])] * 4


def _gathered():
    import torch.distributed as dist

    from support.dist_pool import launch_rank

    from galaxy.distributed.per_device import gather_by_launch_rank
    mine = f"device {launch_rank()}"
    by_position = [None] * dist.get_world_size()
    dist.all_gather_object(by_position, mine)
    return gather_by_launch_rank(mine, launch_rank()), by_position


def test_ranks_started_with_different_orders_disagree():
    """The agreement check (before any process group) names the key."""
    def settings(rank, order):
        cfg = GalaxyConfig(model_path="no-model", mesh_rank_order=order)
        return fingerprint(cfg, None, argparse.Namespace(world=2, rank=rank), "pretrain_galaxy.py")
    assert compare(settings(0, [0, 1]), settings(1, [1, 0]), 1) == (
        "rank 1's settings differ from rank 0's at mesh_rank_order: [0, 1] on rank 0, [1, 0] on rank 1; start "
        "every rank with the same config and arguments")
