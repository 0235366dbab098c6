"""The process mesh: world = pp x dp x Galaxy group size, and every process group built once.

Rank order (docs/design.md section 4). The Galaxy group is the fastest-varying axis, so its ranks are
consecutive (neighbours share the fastest links), then data parallel, then pipeline:

    rank = (pp_index * dp + dp_index) * group_size + galaxy_rank

e.g. pp 2 x dp 2 x group 2 (world 8): stage 0 holds ranks 0-3 (replica 0: 0,1; replica 1: 2,3),
stage 1 holds ranks 4-7. The three families of process groups are the axes of one
torch DeviceMesh named ("pp", "dp", "mp"):

  mp (Galaxy)  same (pp, dp): the ranks that split one transformer block
  dp           same (pp, galaxy rank): replicas whose gradients are averaged
  pp           same (dp, galaxy rank): corresponding ranks of consecutive stages, which
               exchange activations point to point (their shards have identical shapes)

The mesh is built from a resolved galaxy.plan.Plan (its pp, dp and Galaxy shares); uneven shares do
not concern the mesh itself: it only groups ranks. An axis of size 1 has no
process group (`None`), so every collective on it returns early.

Timeouts: torch gives a subgroup its own default (30 minutes), not the world group's, so the
config's timeout_s is passed to every group built here; a peer that stalls then stops the others
within it on every axis, as it does on the world group.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch._C._distributed_c10d import Backend as C10dBackend
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from galaxy.distributed.group import GalaxyGroup
from galaxy.plan import Plan

AXES = ("pp", "dp", "mp")


@dataclass(frozen=True)
class Mesh:
    galaxy: GalaxyGroup
    dp_rank: int
    dp_size: int
    dp_pg: dist.ProcessGroup | None     # None when dp_size == 1
    pp_rank: int
    pp_size: int
    pp_pg: dist.ProcessGroup | None = None     # None when pp_size == 1
    device_mesh: DeviceMesh | None = None
    timeout: timedelta | None = None           # of every group built here; None: torch's default

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def global_rank(pp_index: int, dp_index: int, galaxy_rank: int, dp: int, group_size: int) -> int:
    """The documented rank order, as a function (tests and launch scripts use it)."""
    return (pp_index * dp + dp_index) * group_size + galaxy_rank


def make_mesh(plan: Plan, device_type: str | None = None, timeout: timedelta | None = None) -> Mesh:
    """Build every process group of a resolved plan's mesh (collective: all ranks call it with the
    same plan). The world must be plan.pp * plan.dp * plan.group; timeout bounds every collective
    on the mesh's groups (None: torch's default for new groups).
    """
    pp, dp, size = plan.pp, plan.dp, plan.group
    world, rank = dist.get_world_size(), dist.get_rank()
    if plan.world != world:
        raise ValueError(f"world {world} != pp {pp} x dp {dp} x Galaxy group {size}")
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    # DeviceMesh passes a timeout to its subgroups only through per-axis backend options.
    override = None if timeout is None else {axis: C10dBackend.Options(dist.get_backend(), timeout) for axis in AXES}
    grid = init_device_mesh(device_type, (pp, dp, size), mesh_dim_names=AXES, backend_override=override)
    pg = {axis: grid.get_group(axis) if n > 1 else None for axis, n in zip(AXES, (pp, dp, size))}
    galaxy = GalaxyGroup(rank % size, size, pg["mp"], plan.heads, plan.columns, plan.tokens, plan.decoder_tokens)
    return Mesh(galaxy, (rank // size) % dp, dp, pg["dp"], rank // (size * dp), pp, pg["pp"], grid, timeout)


def pipeline_ends_group(mesh: Mesh) -> dist.ProcessGroup | None:
    """This rank's group with its counterpart at the other end of the pipeline: the first and the
    last stage's ranks of the same data-parallel replica and Galaxy rank (for weights tied across
    the ends); None on a middle stage, or without a pipeline. Collective (stages_group)."""
    return stages_group(mesh, (0, mesh.pp_size - 1))


def stages_group(mesh: Mesh, stages) -> dist.ProcessGroup | None:
    """This rank's group with the ranks of the same data-parallel replica and Galaxy rank on the
    pipeline stages `stages` (indices; for a weight those stages each hold a copy of); None when
    this rank's stage is not one of them, or they are fewer than two.

    Collective over the world: every rank calls it with the same stages. All stages: the pp
    group itself; otherwise one group per (replica, Galaxy rank), built in the same order everywhere.
    """
    stages = sorted(set(stages))
    if len(stages) < 2:
        return None
    if len(stages) == mesh.pp_size:
        return mesh.pp_pg
    size, mine = mesh.galaxy.size, None
    for dp_index in range(mesh.dp_size):
        for g in range(size):
            ranks = [global_rank(p, dp_index, g, mesh.dp_size, size) for p in stages]
            pg = dist.new_group(ranks, timeout=mesh.timeout)
            if dist.get_rank() in ranks:
                mine = pg
    return mine
