"""Slicing a module's parameters to one rank's share (tensor parallelism)."""
from __future__ import annotations

import torch
from torch import nn


def keep_slice(module: nn.Module, name: str, dim: int, start: int, length: int) -> None:
    """Replace parameter `name` of `module` with its [start, start+length) slice along `dim`.

    On the meta device only the shape changes: galaxy.models.build shards a model before any
    weight exists, then reads each slice from the checkpoint.
    """
    full = getattr(module, name)
    if full is None:
        return
    part = full.detach().narrow(dim, start, length).clone()
    setattr(module, name, nn.Parameter(part, requires_grad=full.requires_grad))


def shard_column_parallel(linear: nn.Linear, start: int, length: int) -> None:
    """y = x W^T + b with W's output rows [start, start+length): the output is sharded."""
    keep_slice(linear, "weight", 0, start, length)
    keep_slice(linear, "bias", 0, start, length)
    linear.out_features = length


def shard_row_parallel(linear: nn.Linear, start: int, length: int) -> None:
    """W's input columns [start, start+length): each rank's output is a partial sum.

    The bias stays whole; it is added once, after the partial sums are reduced.
    """
    keep_slice(linear, "weight", 1, start, length)
    linear.in_features = length


def shard_offset(sizes, rank: int) -> int:
    """Where rank's share starts along the split dimension (shares are laid out in rank order)."""
    return sum(sizes[:rank])


@torch.no_grad()
def slice_like(full: torch.Tensor, dim: int, sizes, rank: int) -> torch.Tensor:
    return full.narrow(dim, shard_offset(sizes, rank), sizes[rank])
