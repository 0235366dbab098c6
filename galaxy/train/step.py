"""Mixed precision for the forward pass.

The optimizer step itself lives in Trainer.train_step: the runner (galaxy.runtime.runners.build_runner)
runs forward and backward of the global batch in micro-batches (grad_accum_steps, or a
pipeline's num_microbatches), each micro-batch loss weighted by its share of the batch's loss
units (rows for classification, label tokens for causal LMs), so the accumulated gradient is the
gradient of the full-batch mean and the reported loss is the full-batch mean.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch


def autocast_for(mixed_precision: str, device: torch.device):
    """A context factory for the forward pass: bf16 autocast, or nothing."""
    if mixed_precision == "bf16":
        return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return nullcontext
