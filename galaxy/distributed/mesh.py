"""The process mesh: world = pp x dp x Galaxy group size.

Ranks of one Galaxy group are consecutive (the fastest-varying axis, so neighbours that share
the fastest links share a block), then data parallel, then pipeline:
    rank = (pp_index * dp + dp_index) * group_size + galaxy_rank
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from galaxy.config import read_model_shape, resolve_splits
from galaxy.distributed.group import GalaxyGroup


@dataclass(frozen=True)
class Mesh:
    galaxy: GalaxyGroup
    dp_rank: int
    dp_size: int
    dp_pg: dist.ProcessGroup | None
    pp_rank: int
    pp_size: int


def build_mesh(cfg, rank: int, world: int, shape: dict | None = None) -> Mesh:
    """Build every process group (collectively: all ranks must call this)."""
    shape = shape or read_model_shape(cfg.model_path)
    pp, dp = cfg.pp_deg, cfg.dp_deg
    size = world // (pp * dp)
    splits = resolve_splits(cfg, size, shape)
    galaxy_pg = dp_pg = None
    # new_group must be called by every rank for every group, in the same order.
    for p in range(pp):
        for d in range(dp):
            ranks = [(p * dp + d) * size + g for g in range(size)]
            pg = dist.new_group(ranks) if size > 1 else None
            if rank in ranks:
                galaxy_pg = pg
        for g in range(size):
            ranks = [(p * dp + d) * size + g for d in range(dp)]
            pg = dist.new_group(ranks) if dp > 1 else None
            if rank in ranks:
                dp_pg = pg
    shares = lambda key, total: tuple(splits[key] or (total,) * size)  # noqa: E731 (unused split)
    group = GalaxyGroup(rank % size, size, galaxy_pg,
                        shares("tp_num_attention_heads_list", shape["num_attention_heads"]),
                        shares("tp_intermediate_size_list", shape["intermediate_size"]),
                        shares("seq_scatter_list", cfg.pad_size))
    return Mesh(group, (rank // size) % dp, dp, dp_pg, rank // (size * dp), pp)
