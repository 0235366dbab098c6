"""Gradient buckets: which parameters' gradients travel together in one all-reduce.

Both the gradient sync (galaxy.parallel.grad_sync) and its closed form (galaxy.distributed.
comm_bytes) group the same way, so that the profiler's measured calls and bytes can equal the
closed form exactly. The units are whole layers (and the parameters before and after the layers),
in the order backward finishes them: after-layers, last layer ... first layer, before-layers.
Consecutive units fill a bucket until it holds at least `cap` elements, as DDP fills its own.
"""
from __future__ import annotations

# torch DDP's default bucket size (bucket_cap_mb=25, MiB).
BUCKET_CAP_BYTES = 25 * 2 ** 20


def group_into_buckets(unit_numels: list[int], cap: int) -> list[list[int]]:
    """Indices of consecutive non-empty units per bucket; a bucket closes at >= cap elements."""
    buckets, current, filled = [], [], 0
    for i, numel in enumerate(unit_numels):
        if numel == 0:
            continue
        current.append(i)
        filled += numel
        if filled >= cap:
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    return buckets


def bucket_numels(unit_numels: list[int], cap: int) -> list[int]:
    """Elements per bucket (the all-reduces the gradient sync issues, in order)."""
    return [sum(unit_numels[i] for i in b) for b in group_into_buckets(unit_numels, cap)]
