"""Reading tensors that may be dp-sharded DTensors (sharded data parallelism, sharded_dp.py),
without importing torch.distributed.tensor.

That import (with FSDP's) costs about as much as torch's own, and every process would pay it
through the code that reads parameters (gradient rules, clipping, gathers, checkpoints) though
only a run with dp_sharding makes a DTensor. A DTensor can exist only once its module has been
imported, so each check first looks for the module in sys.modules: not there, nothing is one.
"""
from __future__ import annotations

import sys

import torch
from torch import nn


def dtensor_class():
    """torch's DTensor class if anything has imported it yet, else None."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def is_dtensor(t) -> bool:
    cls = dtensor_class()
    return cls is not None and isinstance(t, cls)


def is_dp_sharded(model: nn.Module) -> bool:
    """Whether `model`'s parameters are sharded over data-parallel replicas (all but the
    `unshardable` are, or none)."""
    return any(is_dtensor(p) for p in model.parameters())


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's part of a (possibly dp-sharded) tensor: the same storage, no communication."""
    return t.to_local() if is_dtensor(t) else t


def full(t: torch.Tensor | None) -> torch.Tensor | None:
    """A dp-sharded tensor gathered to its Galaxy-local shape (collective over the dp group when
    sharded: every replica must call it, in the same order); other tensors as they are."""
    return t.full_tensor() if is_dtensor(t) else t


def like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`value` (the Galaxy-local shape of `param`) sharded as `param` is: this rank's slice,
    taken locally (every replica holds the whole value; no communication)."""
    if not is_dtensor(param):
        return value
    from torch.distributed.tensor import distribute_tensor
    return distribute_tensor(value.to(param.device), param.device_mesh, param.placements, src_data_rank=None)


def dp_group_of(tensors) -> object | None:
    """The process group the first dp-sharded tensor among `tensors` is sharded over (None: none is)."""
    for t in tensors:
        if is_dtensor(t):
            return t.device_mesh.get_group()
    return None
