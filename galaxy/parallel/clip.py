"""Gradient clipping by the global norm of the whole (unsharded) model.

After GradientSync every rank of the Galaxy group holds:
  sharded params            a disjoint slice of the full gradient   -> sum the squares over the group
  sum / replicated params   the full gradient, the same on each rank -> count it once, locally
so ||g||^2 = all_reduce_sum(sq(sharded)) + sq(others): one scalar all-reduce per step, and every
rank gets the same norm and therefore scales by the same factor (the replicas stay identical).

Under dp_sharding (galaxy.parallel.sharded_dp) every gradient is a DTensor of which each replica
holds a disjoint dim-0 slice: the squares above are of the local slices, and one more scalar
all-reduce over the dp group adds the replicas' parts.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from galaxy.models.attached import written_names
from galaxy.parallel.sharded_dp import dp_group_of, local


def _sum_of_squares(grads: list[torch.Tensor], device) -> torch.Tensor:
    # fp32 accumulation whatever the gradient dtype: a norm of bf16 values loses bits otherwise.
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads])
    return norms.square().sum()


@torch.no_grad()
def global_grad_norm(model: torch.nn.Module) -> torch.Tensor:
    """The L2 norm of the full model's gradient (0-d fp32 tensor, equal on every rank)."""
    rules, group = model.attached.rules, model.attached.group
    counted = written_names(model)      # a tied weight's pipeline copy counts on the first stage
    sharded, whole = [], []
    grads = [(name, p.grad) for name, p in model.named_parameters() if p.grad is not None and name in counted]
    for name, g in grads:
        (sharded if rules[name].kind == "sharded" else whole).append(local(g))
    device = next(model.parameters()).device
    sq_sharded = _sum_of_squares(sharded, device)
    if group.pg is not None and sharded:
        dist.all_reduce(sq_sharded, group=group.pg)
    sq = sq_sharded + _sum_of_squares(whole, device)
    # Sharded data parallelism shards every parameter (or none); each replica holds its own slices.
    dp_pg = dp_group_of(g for _, g in grads)
    if dp_pg is not None:
        dist.all_reduce(sq, group=dp_pg)
    return sq.sqrt()


@torch.no_grad()
def clip_grad_norm_(model: torch.nn.Module, max_norm: float, norm: torch.Tensor | None = None) -> torch.Tensor:
    """Scale every gradient by min(1, max_norm / (norm + 1e-6)), as torch's clip_grad_norm_ does.

    norm: the norm to clip by (a pipeline's, summed over its stages); default: this Galaxy
    group's model's (global_grad_norm). Returns the norm before clipping. The factor stays a
    tensor: no host sync on accelerators.
    """
    norm = global_grad_norm(model) if norm is None else norm
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for p in model.parameters():
        if p.grad is not None:
            local(p.grad).mul_(scale.to(p.grad.dtype))
    return norm
