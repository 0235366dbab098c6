"""Projections whose bias the caller adds."""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn


class OutputProjection(nn.Linear):
    """A sub-block's output projection: returns x W^T and leaves the bias to CON.

    Under TP it is row-parallel, so its output is a partial sum and the bias belongs to the
    total: CON adds it once, after the layout transition. Being a module (rather than an
    F.linear on its weight) lets a wrapper such as LoRA (galaxy.peft.lora) add to its output.
    """

    def forward(self, x):
        return F.linear(x, self.weight)
