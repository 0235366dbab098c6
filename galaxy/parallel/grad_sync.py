"""Gradient synchronisation after backward: one flat all-reduce per step over the group.

Parameters tagged "sum" (replicated weights that only saw this rank's tokens) are summed over
the Galaxy group; sharded and replicated ones are already complete (galaxy.parallel.plan).
Under dp_sharding the gradients are DTensors after FSDP's reduce-scatter: each rank sums its own
dp slice, which is the same slice on every rank of its Galaxy group (galaxy.parallel.sharded_dp).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from galaxy.distributed import collectives
from galaxy.parallel.sharded_dp import local


class GradientSync:
    def __init__(self, model: torch.nn.Module, galaxy_pg=None):
        rules = model.attached.rules
        self.galaxy_pg = galaxy_pg
        self.summed = [p for n, p in model.named_parameters()
                       if rules[n].kind == "sum" and p.requires_grad]

    @torch.no_grad()
    def __call__(self) -> None:
        if self.galaxy_pg is None or not self.summed:
            return
        grads = [local(p.grad) for p in self.summed if p.grad is not None]
        flat = _flatten_dense_tensors(grads)
        if collectives.comm_recorder is not None:
            collectives.comm_recorder("all_reduce", flat, dist.get_world_size(self.galaxy_pg))
        dist.all_reduce(flat, group=self.galaxy_pg)
        for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(synced)
