"""The model profile: what a model needs, per sub-block, at any share (`plan.py profile-model`).

Measured once, in one process, on a one-layer model of the family at the config's pad_size
(galaxy.planner.harness); every figure is per row of the batch, so one profile serves every
batch size and micro-batch:

    {"format": "galaxy-model-profile", "version": 1,
     "model_type", "family", "task", "num_labels", "pad_size", "dropout",
     "hf_config": {config.json},                    # what the closed forms read
     "carry_tensors": int,                           # tensors a layer hands the next (1 post-norm, 2 pre-norm)
     "units": {kind: [total, step]},                 # heads (att_tp; step = a K/V group), columns, tokens
     "params": {"embed", "head", "tied", "other",    # first stage, last stage, held by both ends, every stage
                "layer": {"att_tp": [a0, a1], "mlp_tp": [a0, a1],    # a0 + a1 x units on a rank
                          "att_sp": n, "mlp_sp": n, "con": n}},       # whole (SP, CON: both of a layer)
     "act_bytes_per_row": {kind: [c0, c1]},          # saved for backward: c0 + c1 x units, per row
     "flops_per_row": {"att" | "mlp" | "con" | "head": {"fwd", "bwd", "fwd_elementwise",
                                                        "bwd_elementwise"}},   # whole sub-block (con: one)
     "profiler": {...}}                              # galaxy.profiler's figures of the whole layer,
                                                     # the closed form's FLOPs beside them

Activation bytes are counted as galaxy.profiler counts them (saved-tensor hooks, each storage
once, parameters excluded), at two shares per kind, so the linear form is exact for these modules.
"""
from __future__ import annotations

import json
import os

import torch

from galaxy.models.build import model_class
from galaxy.models.registry import family_of
from galaxy.planner.harness import SubBlockBench

FORMAT, VERSION = "galaxy-model-profile", 1
ROWS = 2     # activation bytes are measured on 2 rows and divided (they are linear in rows)


def _linear(f, lo: int, hi: int) -> list[float]:
    """[c0, c1] with f(u) = c0 + c1 u through u = lo and u = hi (c1 = 0 when lo == hi)."""
    f_hi = f(hi)
    if lo == hi:
        return [float(f_hi), 0.0]
    f_lo = f(lo)
    c1 = (f_hi - f_lo) / (hi - lo)
    return [float(f_hi - c1 * hi), float(c1)]


def _half(total: int, step: int) -> int:
    """A share about half the total, a whole number of steps (at least one)."""
    return max(step, total // 2 // step * step)


def _whole_model_params(hf, num_labels) -> dict:
    """Parameters of the whole model on the meta device: first stage, last stage, tied, other."""
    family = family_of(hf.model_type)
    with torch.device("meta"):
        model = model_class(family, None)(hf, num_labels=num_labels)
    count = lambda names: {id(p): p.numel() for n in names for p in getattr(model, n).parameters()}  # noqa: E731
    first, last = count(model.first_stage_modules), count(model.last_stage_modules)
    layers = {id(p) for p in model.layers.parameters()}
    other = {id(p): p.numel() for p in model.parameters()
             if id(p) not in layers and id(p) not in first and id(p) not in last}
    return {"embed": sum(first.values()), "head": sum(last.values()),
            "tied": sum(v for k, v in first.items() if k in last), "other": sum(other.values()),
            "total": sum(p.numel() for p in model.parameters())}


def _layer_params(bench: SubBlockBench, seq: int) -> dict:
    """One layer's parameters per sub-block kind: [c0, c1] (c0 + c1 x share) under TP, else a count."""
    att_total, att_step = bench.units["att_tp"]
    mlp_total, _ = bench.units["mlp_tp"]
    return {
        "att_tp": _linear(lambda u: bench.params("att_tp", u), att_step, att_total),
        "mlp_tp": _linear(lambda u: bench.params("mlp_tp", u), 1, mlp_total),
        "att_sp": bench.params("att_sp", seq), "mlp_sp": bench.params("mlp_sp", seq),
        "con": sum(p.numel() for p in bench.layer.con1.parameters())
        + sum(p.numel() for p in bench.layer.con2.parameters()),
    }


def _saved_bytes(bench: SubBlockBench, kind: str) -> list[float]:
    """[c0, c1] of the bytes a sub-block kind saves for backward for ROWS rows, at a share u."""
    total, step = bench.units[kind]
    lo = total if kind == "embed" else _half(total, step)
    return _linear(lambda u: bench.saved_bytes(kind, u, ROWS), lo, total)


def profile_model(cfg, num_labels: int | None) -> dict:
    """The model profile of cfg's model at cfg.pad_size (see the module docstring)."""
    from galaxy.profiler.cli import synthetic_batch
    from galaxy.profiler.profile import profile_model as profiler_run

    seq = cfg.pad_size
    bench = SubBlockBench(cfg.model_path, seq=seq, num_labels=num_labels, dropout=cfg.dropout)
    with open(os.path.join(cfg.model_path, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    from galaxy.models.build import load_hf_config
    hf = load_hf_config(cfg.model_path, cfg.dropout)
    units = bench.units

    params = _whole_model_params(hf, num_labels)
    params["layer"] = _layer_params(bench, seq)
    params["per_layer"] = sum(p.numel() for p in bench.layer.parameters())
    acts = {kind: [v / ROWS for v in _saved_bytes(bench, kind)]
            for kind in ("att_tp", "att_sp", "mlp_tp", "mlp_sp", "con", "head", "embed")}

    # The profiler on the one-layer model, one row: FLOPs per sub-block, and its activation count.
    batch = synthetic_batch(bench.task, 1, seq, hf.vocab_size, num_labels, cfg.seed, "cpu")
    report = profiler_run(bench.model, batch, repeats=0)
    subs = {s.name: s for s in report.sub_blocks}

    def figures(s) -> dict:
        return {"fwd": s.fwd_flops, "bwd": s.bwd_flops, "fwd_elementwise": s.fwd_elementwise_flops,
                "bwd_elementwise": s.bwd_elementwise_flops}
    flops = {"att": figures(subs["att"]), "mlp": figures(subs["mlp"]), "con": figures(subs["con1"])}
    t = report.totals
    layer_sum = {k: sum(figures(s)[k] for s in subs.values()) for k in flops["att"]}
    totals = {"fwd": t.fwd_flops, "bwd": t.bwd_flops, "fwd_elementwise": t.elementwise_flops,
              "bwd_elementwise": t.bwd_elementwise_flops}
    flops["head"] = {k: max(0, totals[k] - layer_sum[k]) for k in totals}     # embeddings + head
    hf1 = bench.hf
    closed = bench.family.matmul_flops(hf1, 1, seq, num_labels)["total"] if bench.family.matmul_flops else None
    return {
        "format": FORMAT, "version": VERSION,
        "model_path": cfg.model_path, "model_type": hf.model_type, "family": bench.family.name,
        "task": bench.task, "num_labels": num_labels, "pad_size": seq, "dropout": cfg.dropout,
        "hf_config": raw, "carry_tensors": bench.model.carry_size,
        "units": {k: list(v) for k, v in units.items()},
        "params": params, "act_bytes_per_row": acts, "flops_per_row": flops,
        "profiler": {"layer_act_bytes_per_row": {s.name: s.act_bytes for s in report.sub_blocks},
                     "fwd_flops_per_row_one_layer": t.fwd_flops,
                     "closed_form_fwd_flops_per_row_one_layer": closed,
                     "flops_match_closed_form": closed == t.fwd_flops if closed is not None else None},
    }


class ModelProfileError(ValueError):
    def __init__(self, message: str):
        super().__init__(" ".join(str(message).splitlines()))


def check_model_profile(doc, where: str) -> dict:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ModelProfileError(f"{where} is not a model profile (format {FORMAT!r}); write one with "
                                f"plan.py profile-model")
    if doc.get("version") != VERSION:
        raise ModelProfileError(f"{where} has version {doc.get('version')!r}; this galaxy reads version {VERSION}")
    for key in ("hf_config", "units", "params", "act_bytes_per_row", "flops_per_row", "pad_size", "carry_tensors"):
        if key not in doc:
            raise ModelProfileError(f"{where} has no '{key}'; write it again with plan.py profile-model")
    return doc
