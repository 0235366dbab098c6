"""Gather sharded parameters (or their gradients) back to full shape on every rank.

Used for export, checkpoints and fidelity tests; not on the training hot path. Under dp_sharding
a parameter is first gathered over the dp group (to this rank's Galaxy-local shape), then over the
Galaxy group: every replica takes part (galaxy.parallel.sharded_dp.full).
"""
from __future__ import annotations

import torch

from galaxy.distributed.collectives import all_gather_dim, all_gather_sequence
from galaxy.layers.sharding import rank_major_to_blocks
from galaxy.parallel.dtensors import full


@torch.no_grad()
def gather_full(model: torch.nn.Module, grads: bool = False, names=None) -> dict[str, torch.Tensor]:
    """names: only these parameters (default: all). Every rank must pass the same names."""
    pg = model.attached.group.pg
    out = {}
    for name, p in model.named_parameters():
        t = p.grad if grads else p
        if t is None or (names is not None and name not in names):
            continue
        out[name] = gather_param(full(t.detach()), model.attached.rules[name], pg)
    return out


@torch.no_grad()
def gather_param(t: torch.Tensor, rule, pg) -> torch.Tensor:
    """A rank's share of a tensor shaped like a parameter (the parameter, its gradient, its
    optimizer state) -> the whole tensor, under the parameter's ParamRule. Collective over pg
    for a sharded one; a copy of anything else."""
    if rule.kind != "sharded":
        return t.detach().clone()
    gathered = all_gather_dim(t, [rule.parts * s for s in rule.sizes], rule.dim, pg)
    return rank_major_to_blocks(gathered, rule.dim, rule.sizes, rule.parts)


@torch.no_grad()
def full_sequence_logits(model: torch.nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """A causal LM under a sequence-sharded CON layout returns its own tokens' logits
    [b, s_rank, vocab]; gather them to [b, S, vocab]. Other layouts are returned as they are."""
    g = model.head_group
    return logits if g is None else all_gather_sequence(logits.contiguous(), g.tokens, g.pg)
