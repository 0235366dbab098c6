"""Two random streams, so dropout masks follow the activation layout (docs/design.md section 3).

Replicated (R) activations: every rank of a Galaxy group must draw the same mask. They use the
default generator, seeded identically on every rank and advanced identically because no
rank-specific draw ever touches it.
Sharded activations (S tokens, TP heads): each rank draws for its own part. They use a second
stream seeded with `seed + 1 + rank`, swapped in around the draw.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch


class ShardedRNG:
    def __init__(self, seed: int, rank: int, device: torch.device):
        self.device = device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed + 1 + rank)
            self.state = self._get()

    def _get(self):
        return torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else torch.get_rng_state()

    def _set(self, state) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    @contextmanager
    def fork(self):
        default = self._get()
        self._set(self.state)
        try:
            yield
        finally:
            self.state = self._get()
            self._set(default)


class ShardedDropout:
    """Mixin of a sub-block that draws dropout masks (attention dropout, CON's dropout).

    Its draws happen inside `with self.rng_scope():`. Until a plan says otherwise that is the
    default generator (the replicated stream); where the sub-block's activations are sharded
    (TP heads, S tokens) the plan routes them to the rank's own stream with draw_dropout_from.
    """
    rng_scope = nullcontext

    def draw_dropout_from(self, rng: ShardedRNG) -> None:
        self.rng_scope = rng.fork


class Dropout(ShardedDropout, torch.nn.Module):
    """Dropout on activations outside the sub-blocks that lie in a plan's layout (T5's dropout
    after the decoder's final norm, on the CON layout): it draws from the default stream until a
    plan routes it to the rank's own (a model's con_params under CON SP)."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        with self.rng_scope():
            return torch.nn.functional.dropout(x, self.p, True)
