"""Random-number state for checkpoints.

Two kinds of stream feed dropout (galaxy/layers/rng.py):
  replicated  torch's default generator (CPU, and the device's on CUDA). Seeded identically and
              advanced identically on every rank, so rank 0's copy stands for all; it is
              restored on every rank under any plan and world size.
  sharded     the ShardedRNG of each rank (TP heads, SP tokens). Its state belongs to one rank
              of one layout (plan, shares, world size). It is restored only when the layout and
              device type are unchanged; otherwise every rank starts a fresh stream seeded from
              (seed, rank, step), so no stream replays masks already drawn. Dropout masks then
              differ from an uninterrupted run (they would anyway: the tokens and heads each
              rank owns have changed); with dropout 0, as in exactness tests, nothing differs.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from galaxy.layers.rng import ShardedRNG


def sharded_rng_of(model) -> ShardedRNG | None:
    """The ShardedRNG a plan wired into the model (None in serial training: nothing is sharded)."""
    for module in model.modules():
        owner = getattr(getattr(module, "rng_scope", None), "__self__", None)
        if isinstance(owner, ShardedRNG):
            return owner
    return None


def capture_rng(model, device: torch.device) -> dict[str, torch.Tensor]:
    """Collective over the default group. {"cpu", "cuda"?, "sharded.<rank>"?: uint8 tensors}."""
    out = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    sharded = sharded_rng_of(model)
    mine = None if sharded is None else sharded.state.cpu()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    for rank, state in enumerate(every):
        if state is not None:
            out[f"sharded.{rank}"] = state
    return out


def restore_rng(model, device: torch.device, saved: dict[str, torch.Tensor], *,
                same_layout: bool, seed: int, step: int) -> None:
    torch.set_rng_state(saved["cpu"])
    if device.type == "cuda" and "cuda" in saved:
        torch.cuda.set_rng_state(saved["cuda"], device)
    sharded = sharded_rng_of(model)
    if sharded is None:
        return
    rank = dist.get_rank()
    mine = saved.get(f"sharded.{rank}")
    if same_layout and mine is not None:
        sharded.state = mine
    else:
        generator = torch.Generator(device=device)
        # A seed no uninterrupted run uses: the run's own streams are seed + 1 + rank.
        generator.manual_seed(hash((seed, rank, step)) & (2**63 - 1))
        sharded.state = generator.get_state()
