"""Random initial values that every rank draws identically, whatever the plan or stage.

A new parameter is drawn at its full (unsharded) shape from a generator seeded by the run's
seed and the parameter's name, then sliced to the rank's share. So its values do not depend on
the world size, the plan, the pipeline stage or the order in which modules are created, and a
serial run draws exactly what a sharded one assembles.
"""
from __future__ import annotations

import zlib

import torch


def named_generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)


@torch.no_grad()
def init_linear(linear: torch.nn.Linear, gen: torch.Generator, std: float) -> None:
    """Weight ~ N(0, std) (std 0: zeros), bias 0, as Hugging Face initialises BERT and Llama."""
    if std > 0:
        linear.weight.copy_(torch.randn(linear.weight.shape, generator=gen) * std)
    else:
        linear.weight.zero_()
    if linear.bias is not None:
        linear.bias.zero_()
