"""Rank-side helpers for fidelity tests: run galaxy under a plan and HF serially, compare."""
from __future__ import annotations

import torch
import torch.distributed as dist

from galaxy.distributed.group import GalaxyGroup
from galaxy.models.bert import HF_NAMES
from galaxy.models.build import build_model
from galaxy.models.weights import NameMap
from galaxy.parallel.full_state import gather_full
from galaxy.parallel.grad_sync import GradientSync
from galaxy.parallel.plan import ParallelPlan


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to max |b| (the scale of the reference tensor)."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def world_group(heads, inter, seq) -> GalaxyGroup:
    rank, world = dist.get_rank(), dist.get_world_size()
    return GalaxyGroup(rank, world, dist.group.WORLD if world > 1 else None,
                       tuple(heads), tuple(inter), tuple(seq))


def hf_bert(model_dir):
    from transformers import BertForSequenceClassification
    return BertForSequenceClassification.from_pretrained(model_dir, attn_implementation="eager").train()


def worst_param_error(galaxy_full: dict, hf_model, grads: bool) -> tuple[float, str]:
    """Largest relative error over all parameters (or gradients), and where it is.

    Some gradients are exactly zero in exact arithmetic (the key bias: softmax ignores a shift
    shared by all keys), so the reference holds only rounding noise there. Each tensor's error is
    therefore taken relative to max(its own scale, 1e-3 x the largest reference value in the
    model): with the 1e-5 tolerance, a tensor whose true value is zero must match to within
    1e-8 of the model's largest value (on all-MiniLM-L6-v2 the key-bias gradient is ~1e-10
    against a largest gradient of ~0.16).
    """
    to_hf = NameMap(HF_NAMES)
    ref = {n: (p.grad if grads else p.detach()) for n, p in hf_model.named_parameters()}
    floor = 1e-3 * max(t.abs().max().item() for t in ref.values())
    worst, where = 0.0, ""
    for name, t in galaxy_full.items():
        r = ref[to_hf(name)]
        err = ((t - r).abs().max() / max(r.abs().max().item(), floor)).item()
        if err > worst:
            worst, where = err, name
    return worst, where
