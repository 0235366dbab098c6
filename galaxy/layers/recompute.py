"""Activation checkpointing of whole layers, with the dropout masks of the first forward.

A checkpointed layer keeps only its inputs (the carry entering it) for backward and runs its
forward again during backward to rebuild what the gradient needs: about one extra forward of
compute for the memory of every activation inside the layer.

The recomputation must draw the same dropout masks. torch's checkpoint restores the default
generator (the replicated stream, docs/design.md section 3) by itself; the sharded stream
(galaxy.layers.rng.ShardedRNG) is swapped in and out around each draw, so it is replayed here:
its state when the layer's forward began is put back for the recomputation, and the state the
stream had reached since then is restored afterwards.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
from torch.utils.checkpoint import checkpoint

from galaxy.layers.rng import ShardedRNG


@contextmanager
def _replaying(rng: ShardedRNG, state: torch.Tensor):
    later = rng.state
    rng.state = state
    try:
        yield
    finally:
        rng.state = later


def run_checkpointed(fn, *args, rng: ShardedRNG | None = None, **kwargs):
    """fn(*args, **kwargs), storing only the inputs for backward (torch's non-reentrant
    checkpoint). rng: the sharded stream the layer's dropout may draw from (None: none)."""
    if rng is None:
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)
    start = rng.state
    return checkpoint(fn, *args, use_reentrant=False,
                      context_fn=lambda: (nullcontext(), _replaying(rng, start)), **kwargs)
