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
     "profiler": {...},                              # galaxy.profiler's figures of the whole layer,
                                                     # the closed form's FLOPs beside them
     "peft": {...}}                                  # with a PEFT method in the config: the same for
                                                     # the model it makes (galaxy.planner.method_profile)

Every figure outside "peft" is the model's under full fine-tuning, whatever the config's method:
one profile costs the method and full fine-tuning alike. A profile without "peft" (taken for full
fine-tuning, or before methods were profiled) still reads; searching for a method needs it.

Activation bytes are counted as galaxy.profiler counts them (saved-tensor hooks, each storage
once, parameters excluded), at two shares per kind, so the linear form is exact for these modules.
"""
from __future__ import annotations

import json
import os

import torch

from galaxy.models.build import model_class
from galaxy.models.registry import family_of
from galaxy.planner.counting import linear as _linear
from galaxy.planner.counting import part_counts
from galaxy.planner.harness import SubBlockBench
from galaxy.planner.method import describe
from galaxy.planner.method_profile import method_section

FORMAT, VERSION = "galaxy-model-profile", 1
ENCDEC_VERSION = 2     # an encoder-decoder's (galaxy.planner.encdec_profile)
ROWS = 2     # activation bytes are measured on 2 rows and divided (they are linear in rows)


def _half(total: int, step: int) -> int:
    """A share about half the total, a whole number of steps (at least one)."""
    return max(step, total // 2 // step * step)


def _whole_model_params(hf, num_labels) -> dict:
    """Parameters of the whole model on the meta device: first stage, last stage, tied, other."""
    family = family_of(hf.model_type)
    with torch.device("meta"):
        model = model_class(family, None)(hf, num_labels=num_labels)
    return part_counts(model)


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
    peft = method_section(cfg, num_labels, hf)
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
        **({"peft": peft} if peft else {}),
    }


class ModelProfileError(ValueError):
    def __init__(self, message: str):
        super().__init__(" ".join(str(message).splitlines()))


def check_model_profile(doc, where: str) -> dict:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ModelProfileError(f"{where} is not a model profile (format {FORMAT!r}); write one with "
                                f"plan.py profile-model")
    if doc.get("version") == ENCDEC_VERSION and doc.get("encoder_decoder"):
        return _check_encdec(doc, where)
    if doc.get("version") != VERSION:
        raise ModelProfileError(f"{where} has version {doc.get('version')!r}; this galaxy reads version {VERSION} "
                                f"(version {ENCDEC_VERSION}: an encoder-decoder's)")
    for key in ("hf_config", "units", "params", "act_bytes_per_row", "flops_per_row", "pad_size", "carry_tensors"):
        if key not in doc:
            raise ModelProfileError(f"{where} has no '{key}'; write it again with plan.py profile-model")
    for key in ("signature", "backbone", "params", "trainable", "summed_outside", "act_bytes_per_row"):
        if "peft" in doc and key not in doc["peft"]:
            raise ModelProfileError(f"{where} has no 'peft' '{key}'; write it again with plan.py profile-model")
    return doc


def _check_encdec(doc: dict, where: str) -> dict:
    """A version-2 profile: an encoder-decoder's, one section per stack."""
    for key in ("hf_config", "units", "params", "act_bytes_per_row", "flops_per_row", "pad_size",
                "target_pad_size", "carry_tensors", "stacks"):
        if key not in doc:
            raise ModelProfileError(f"{where} has no '{key}'; write it again with plan.py profile-model")
    for stack in ("encoder", "decoder"):
        for key in ("layers", "tokens", "units", "params", "act_bytes_per_row", "flops_per_row"):
            if key not in doc["stacks"].get(stack, {}):
                raise ModelProfileError(f"{where} has no '{stack}' '{key}'; write it again with plan.py profile-model")
    return doc


def check_method(doc: dict, signature: dict, where: str) -> dict | None:
    """The profile's "peft" section when it is of the method `signature` names (None: full
    fine-tuning); ModelProfileError when the profile was taken for another method."""
    if signature["method"] == "full":
        return None
    section = doc.get("peft")
    if section is None or section["signature"] != signature:
        taken = describe(section["signature"]) if section else "full fine-tuning"
        raise ModelProfileError(f"model profile {where} was taken for {taken}, the config asks for "
                                f"{describe(signature)}; run plan.py profile-model on this config")
    return section
