"""Slicing a module's parameters to one rank's share (tensor parallelism).

A share is a contiguous range [start, start+length) of one dimension, or, for a fused
projection whose dimension is `parts` equal blocks (GPT-2's c_attn: rows [q; k; v], 3 blocks of
hidden each), the same range of every block, concatenated in block order: a rank that owns heads
3..4 keeps [q_3 q_4; k_3 k_4; v_3 v_4], so its local output still splits into q, k, v evenly.
"""
from __future__ import annotations

import torch
from torch import nn


def block_spans(total: int, start: int, length: int, parts: int = 1) -> list[tuple[int, int]]:
    """(start, length) in the full dimension of each piece a share keeps, in the order kept.
    total: the full dimension's size, `parts` blocks of total // parts."""
    block = total // parts
    return [(k * block + start, length) for k in range(parts)]


def take_blocks(full: torch.Tensor, dim: int, start: int, length: int, parts: int = 1) -> torch.Tensor:
    """The share [start, start+length) of every one of `parts` blocks of `dim`, concatenated
    (a view when parts is 1)."""
    pieces = [full.narrow(dim, s, n) for s, n in block_spans(full.shape[dim], start, length, parts)]
    return pieces[0] if parts == 1 else torch.cat(pieces, dim)


def keep_slice(module: nn.Module, name: str, dim: int, start: int, length: int, parts: int = 1) -> None:
    """Replace parameter `name` of `module` with its share along `dim` (take_blocks).

    On the meta device only the shape changes: galaxy.models.build shards a model before any
    weight exists, then reads each slice from the checkpoint.
    """
    full = getattr(module, name)
    if full is None:
        return
    part = take_blocks(full.detach(), dim, start, length, parts).clone()
    setattr(module, name, nn.Parameter(part, requires_grad=full.requires_grad))


def shard_column_parallel(linear: nn.Linear, start: int, length: int, parts: int = 1) -> None:
    """y = x W^T + b with W's output rows [start, start+length) (of each of `parts` blocks):
    the output is sharded."""
    keep_slice(linear, "weight", 0, start, length, parts)
    keep_slice(linear, "bias", 0, start, length, parts)
    linear.out_features = parts * length


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
def slice_like(full: torch.Tensor, dim: int, sizes, rank: int, parts: int = 1) -> torch.Tensor:
    return take_blocks(full, dim, shard_offset(sizes, rank), sizes[rank], parts)


def rank_major_to_blocks(gathered: torch.Tensor, dim: int, sizes, parts: int) -> torch.Tensor:
    """Every rank's share concatenated in rank order ([r0: b0 b1 b2][r1: b0 b1 b2] for 3 parts)
    -> the full tensor, block by block ([b0: r0 r1][b1: r0 r1][b2: r0 r1])."""
    if parts == 1:
        return gathered
    per_rank = gathered.split([parts * s for s in sizes], dim)
    pieces = [shard.split(size, dim) for shard, size in zip(per_rank, sizes)]   # [rank][block]
    return torch.cat([pieces[r][k] for k in range(parts) for r in range(len(sizes))], dim)
