"""Counting helpers of the model profiles: a two-point linear fit of a figure over a share, and
a whole model's parameters by the part of it a pipeline stage holds."""
from __future__ import annotations

import torch

from galaxy.peft.side import SIDE_FIRST, SIDE_LAST


def linear(f, lo: int, hi: int) -> list[float]:
    """[c0, c1] with f(u) = c0 + c1 u through u = lo and u = hi (c1 = 0 when lo == hi)."""
    f_hi = f(hi)
    if lo == hi:
        return [float(f_hi), 0.0]
    f_lo = f(lo)
    c1 = (f_hi - f_lo) / (hi - lo)
    return [float(f_hi - c1 * hi), float(c1)]


def part_counts(model, keep=lambda name, p: True) -> dict:
    """{"embed", "head", "tied", "other", "total"}: the parameters `keep` (full name, parameter)
    selects of a whole model's parts outside its layers (first stage, last stage, both, every
    stage; a side network's input and output go with the stage that holds them, galaxy.peft.side)."""
    kept = {id(p): p.numel() for n, p in model.named_parameters() if keep(n, p)}

    def count(names):
        modules = [getattr(model, n, None) for n in names]
        return {id(p): kept[id(p)] for m in modules if isinstance(m, torch.nn.Module)
                for p in m.parameters() if id(p) in kept}
    first = count(model.first_stage_modules + SIDE_FIRST)
    last = count(model.last_stage_modules + SIDE_LAST)
    layers = {id(p) for p in model.layers.parameters()}
    other = {k: v for k, v in kept.items() if k not in layers and k not in first and k not in last}
    return {"embed": sum(first.values()), "head": sum(last.values()),
            "tied": sum(v for k, v in first.items() if k in last), "other": sum(other.values()),
            "total": sum(kept.values())}
