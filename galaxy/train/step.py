"""One optimizer step: micro-batches, mixed precision, gradient sync, clipping, the update.

`batch_size` is the global batch of one optimizer step. Under grad_accum_steps = n it is cut into
n equal micro-batches of batch_size / n rows; each micro-batch loss (the mean over its rows) is
divided by n before backward, so the accumulated gradient is the gradient of the full-batch mean,
and the reported loss (the sum of the scaled micro losses) is the full-batch mean loss: the same
numbers as without accumulation, up to rounding.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from galaxy.train.clip import clip_grad_norm_


def autocast_for(mixed_precision: str, device: torch.device):
    """A context factory for the forward pass: bf16 autocast, or nothing."""
    if mixed_precision == "bf16":
        return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return nullcontext


def micro_batches(batch: dict, n: int) -> list[dict]:
    """Cut every [B, ...] tensor of a batch into n equal [B/n, ...] pieces, in row order."""
    if n == 1:
        return [batch]
    pieces = {k: v.chunk(n) for k, v in batch.items()}
    return [{k: v[i] for k, v in pieces.items()} for i in range(n)]


class OptimizerStep:
    """Callable: (batch on device, 1-based step k) -> (full-batch mean loss, grad norm or None)."""

    def __init__(self, model, optimizer, sync, schedule, *, grad_accum_steps: int = 1,
                 clip_grad: float | None = None, autocast=nullcontext):
        self.model, self.optimizer, self.sync, self.schedule = model, optimizer, sync, schedule
        self.accum, self.clip, self.autocast = grad_accum_steps, clip_grad, autocast

    def __call__(self, batch: dict, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        loss_sum = None
        for micro in micro_batches(batch, self.accum):
            with self.autocast():
                _, loss = self.model(**micro)           # mean over the micro-batch, every rank
            scaled = loss.float() / self.accum
            scaled.backward()
            loss_sum = scaled.detach() if loss_sum is None else loss_sum + scaled.detach()
        self.sync()                                     # once per step: the sum is linear
        norm = clip_grad_norm_(self.model, self.clip) if self.clip is not None else None
        self.schedule.apply(self.optimizer, k)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum, norm
