"""Gradient clipping by the global norm of the whole (unsharded) model.

After GradientSync every rank of the Galaxy group holds:
  sharded params            a disjoint slice of the full gradient   -> sum the squares over the group
  sum / replicated params   the full gradient, the same on each rank -> count it once, locally
so ||g||^2 = all_reduce_sum(sq(sharded)) + sq(others): one scalar all-reduce per step, and every
rank gets the same norm and therefore scales by the same factor (the replicas stay identical).

Under dp_sharding (galaxy.parallel.sharded_dp) every gradient is a DTensor of which each replica
holds a disjoint dim-0 slice: the squares above are of the local slices, and one more scalar
all-reduce over the dp group adds the replicas' parts (a parameter FSDP cannot shard, a scalar,
stays whole on every replica and is counted once).
"""
from __future__ import annotations

import torch

from galaxy.distributed import waiting
from galaxy.models.attached import written_names
from galaxy.parallel.dtensors import dp_group_of, is_dtensor, local


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
    grads = [(name, p.grad) for name, p in model.named_parameters() if p.grad is not None and name in counted]
    device = next(model.parameters()).device
    # [Galaxy-sharded, whole] x [dp-sharded (DTensor), replicated over dp]: squares of local values.
    sq = torch.zeros(2, 2, dtype=torch.float32, device=device)
    for row, galaxy_sharded in enumerate((True, False)):
        for col, dp_sharded in enumerate((True, False)):
            sq[row, col] = _sum_of_squares([local(g) for name, g in grads
                                            if (rules[name].kind == "sharded") == galaxy_sharded
                                            and is_dtensor(g) == dp_sharded], device)
    if group.pg is not None and any(rules[name].kind == "sharded" for name, _ in grads):
        waiting.all_reduce(sq[0], group=group.pg)
    per_rank = sq.sum(dim=0)                      # [dp-sharded, dp-replicated]
    dp_pg = dp_group_of(g for _, g in grads)      # dp_sharding: each replica holds its own slices
    if dp_pg is not None:
        waiting.all_reduce(per_rank[:1], group=dp_pg)
    return per_rank.sum().sqrt()


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
