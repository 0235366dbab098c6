"""Learning-rate schedules: linear warm-up, then constant, linear or cosine decay.

The learning rate of optimizer step k (1-based, k = 1..total) is base_lr * factor(k):

  warm-up   k <= W:  k / W                  (the first step already moves; the W-th reaches base_lr)
  after     p = (k - W - 1) / (T - W)       in [0, 1): the first step after warm-up runs at base_lr
            constant: 1    linear: 1 - p    cosine: (1 + cos(pi p)) / 2

so no step is wasted at lr 0 at either end (the last step runs at base_lr / (T - W) under linear).
The schedule is a pure function of the step and the config: nothing but the step needs saving,
and a resumed run sets exactly the rates the uninterrupted run would have set.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

KINDS = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class LRSchedule:
    kind: str             # constant | linear | cosine
    base_lr: float
    warmup_steps: int     # W
    total_steps: int      # T, optimizer steps of the whole run

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"lr_schedule must be one of {KINDS}, got {self.kind!r}")

    def factor(self, k: int) -> float:
        w, t = self.warmup_steps, self.total_steps
        if k <= w:
            return k / w
        if self.kind == "constant" or t <= w:
            return 1.0
        p = (k - w - 1) / (t - w)
        if self.kind == "linear":
            return 1.0 - p
        return 0.5 * (1.0 + math.cos(math.pi * p))

    def lr(self, k: int) -> float:
        return self.base_lr * self.factor(k)

    def apply(self, optimizer, k: int) -> float:
        """Set the rate of step k on every parameter group; returns it."""
        lr = self.lr(k)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr

    def state_dict(self) -> dict:
        return asdict(self)
