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

Uneven Galaxy shares do not concern the mesh: it only groups ranks. An axis of size 1 has no
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

from galaxy.config import resolve_splits
from galaxy.distributed.group import GalaxyGroup

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


def make_mesh(pp: int, dp: int, heads, intermediate, seq, device_type: str | None = None,
              timeout: timedelta | None = None) -> Mesh:
    """Build every process group (collective: all ranks call it with the same arguments).

    heads, intermediate, seq: the Galaxy shares, one entry per rank of a Galaxy group, so the
    group size is len(seq) and the world must be pp * dp * len(seq). timeout bounds every
    collective on the mesh's groups (None: torch's default for new groups).
    """
    size, world, rank = len(seq), dist.get_world_size(), dist.get_rank()
    if not len(heads) == len(intermediate) == size:
        raise ValueError(f"shares disagree on the Galaxy group size: heads {heads}, "
                         f"intermediate {intermediate}, seq {seq}")
    if pp * dp * size != world:
        raise ValueError(f"world {world} != pp {pp} x dp {dp} x Galaxy group {size}")
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    # DeviceMesh passes a timeout to its subgroups only through per-axis backend options.
    override = None if timeout is None else {axis: C10dBackend.Options(dist.get_backend(), timeout) for axis in AXES}
    grid = init_device_mesh(device_type, (pp, dp, size), mesh_dim_names=AXES, backend_override=override)
    pg = {axis: grid.get_group(axis) if n > 1 else None for axis, n in zip(AXES, (pp, dp, size))}
    galaxy = GalaxyGroup(rank % size, size, pg["mp"], tuple(heads), tuple(intermediate), tuple(seq))
    return Mesh(galaxy, (rank // size) % dp, dp, pg["dp"], rank // (size * dp), pp, pg["pp"], grid, timeout)


def pipeline_ends_group(mesh: Mesh) -> dist.ProcessGroup | None:
    """This rank's group with its counterpart at the other end of the pipeline: the first and the
    last stage's ranks of the same data-parallel replica and Galaxy rank (for weights tied across
    the ends); None on a middle stage, or without a pipeline.

    Collective over the world: every rank calls it. pp 2: the pp group is that pair already;
    deeper pipelines build one pair group per (replica, Galaxy rank), in the same order everywhere.
    """
    if mesh.pp_size <= 2:
        return mesh.pp_pg
    size, mine = mesh.galaxy.size, None
    for dp_index in range(mesh.dp_size):
        for g in range(size):
            pair = [global_rank(0, dp_index, g, mesh.dp_size, size),
                    global_rank(mesh.pp_size - 1, dp_index, g, mesh.dp_size, size)]
            pg = dist.new_group(pair, timeout=mesh.timeout)
            if dist.get_rank() in pair:
                mine = pg
    return mine


def build_mesh(cfg, rank: int, world: int, shape: dict) -> Mesh:
    """The mesh a run config asks for: pp_deg x dp_deg x (what remains) Galaxy ranks, on a
    model of `shape` (galaxy.models.shape.read_model_shape)."""
    if rank != dist.get_rank() or world != dist.get_world_size():
        raise ValueError(f"rank {rank} / world {world} disagree with the process group "
                         f"({dist.get_rank()} / {dist.get_world_size()})")
    size = world // (cfg.pp_deg * cfg.dp_deg)
    splits = resolve_splits(cfg, size, shape)
    # A split the plan does not use may be None (it cannot be made): any placeholder will do.
    shares = lambda key, total: tuple(splits[key] or (total,) * size)  # noqa: E731
    return make_mesh(cfg.pp_deg, cfg.dp_deg,
                     shares("tp_num_attention_heads_list", shape["num_attention_heads"]),
                     shares("tp_intermediate_size_list", shape["intermediate_size"]),
                     shares("seq_scatter_list", cfg.pad_size), timeout=timedelta(seconds=cfg.timeout_s))
