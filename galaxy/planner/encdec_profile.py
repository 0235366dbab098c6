"""The model profile of an encoder-decoder (BART, T5): version 2, one section per stack
(`plan.py profile-model`; galaxy.planner.model_profile takes the other families' version 1).

Measured in one process on one encoder layer and one decoder layer of the family
(galaxy.planner.encdec_bench), S = pad_size source tokens, T = target_pad_size target tokens
(pad_size when unset); every figure is per row of the batch:

    {"format": "galaxy-model-profile", "version": 2, "encoder_decoder": true,
     "model_type", "family", "task", "num_labels", "pad_size", "target_pad_size", "dropout",
     "hf_config", "carry_tensors",                   # tensors a layer hands the next, per stack
     "units": {"embed": [S, S], "head": [T, 1]},    # the head reads target tokens
     "params": {"embed", "head", "tied", "other", "total",    # outside the layers, as version 1
                "by_heads"},                                  # of "other": split by heads under ATT TP
     "act_bytes_per_row": {"embed": [c0, 0], "head": [c0, c1]},
     "flops_per_row": {"head": {"fwd", "bwd", ...}},  # the closed form's LM head (or classifier)
     "stacks": {"encoder" | "decoder": {
         "layers": n, "tokens": S | T,
         "units": {kind: [total, step]},             # att_tp, att_sp, [xatt_tp, xatt_sp,] mlp_tp, mlp_sp, con
         "params": {"att_tp": [a0, a1], "mlp_tp": [a0, a1], ["xatt_tp": [a0, a1],]   # a0 + a1 x units
                    "att_sp": n, "mlp_sp": n, ["xatt_sp": n,] "con": n},         # whole; con: every CON
         "per_layer": n,
         "cons": 2 | 3,                              # CONs a layer runs (the decoder's CONX too)
         "act_bytes_per_row": {kind: [c0, c1]},      # saved for backward at u units (con: one CON)
         "flops_per_row": {"att" | "mlp" | "con" [| "xatt"]: {"fwd", "bwd", "fwd_elementwise",
                                                              "bwd_elementwise"}}}},   # one sub-block, whole
                                                     # (xatt also "fwd_memory": its K/V projections)
     "profiler": {...},                              # the closed forms beside galaxy.profiler's count
     "peft": {...}}                                  # the config's PEFT method (galaxy.planner.encdec_method)

XATT's K/V come from the memory (the encoder's output, S tokens, whole on every rank): its
FLOPs and saved bytes at any share include the S-token K/V projections of the rank's heads.
"""
from __future__ import annotations

import json
import os

import torch

from galaxy.config.world import target_tokens
from galaxy.models.build import load_hf_config, model_class
from galaxy.models.registry import family_of
from galaxy.planner.counting import linear, part_counts
from galaxy.planner.encdec_bench import STACK_KINDS, EncDecBench
from galaxy.planner.encdec_method import encdec_method_section

FORMAT, VERSION = "galaxy-model-profile", 2
ROWS = 2     # activation bytes are measured on 2 rows and divided (they are linear in rows)
# closed-form parts (galaxy.models.encdec_forms) of one sub-block, per stack
CLOSED_PARTS = {"encoder": {"att": ("encoder_qkv", "encoder_attention", "encoder_out"), "mlp": ("encoder_mlp",)},
                "decoder": {"att": ("decoder_qkv", "decoder_attention", "decoder_out"),
                            "xatt": ("cross_q", "cross_kv", "cross_attention", "cross_out"), "mlp": ("decoder_mlp",)}}


def _half(total: int) -> int:
    return max(1, total // 2)


def _stack_section(bench: EncDecBench, stack: str, layers: int, report) -> dict:
    units = {k: list(bench.units[stack][k]) for k in STACK_KINDS[stack]}
    params, acts = {}, {}
    for kind in STACK_KINDS[stack]:
        total = units[kind][0]
        count = lambda u, kind=kind: bench.params(stack, kind, u)           # noqa: E731
        params[kind] = linear(count, _half(total), total) if kind.endswith("_tp") else count(total)
        saved = lambda u, kind=kind: bench.saved_bytes(stack, kind, u, ROWS) / ROWS    # noqa: E731
        acts[kind] = linear(saved, _half(total), total)
    params["con"] = bench.con_params(stack)
    layer = bench.layers[stack]
    return {"layers": layers, "tokens": bench.tokens(stack), "units": units, "params": params,
            "per_layer": sum(p.numel() for p in layer.parameters()), "cons": len(layer.cons),
            "act_bytes_per_row": acts, "flops_per_row": _measured_flops(report, 0 if stack == "encoder" else 1)}


def _figures(s) -> dict:
    return {"fwd": s.fwd_flops, "bwd": s.bwd_flops, "fwd_elementwise": s.fwd_elementwise_flops,
            "bwd_elementwise": s.bwd_elementwise_flops}


def _measured_flops(report, layer: int) -> dict:
    """galaxy.profiler's figures of one layer's sub-blocks (con: CON1's; every CON has its shape)."""
    subs = {s.name: s for s in report.sub_blocks if s.layer == layer}
    out = {name: _figures(subs[name]) for name in ("att", "xatt", "mlp") if name in subs}
    out["con"] = _figures(subs["con1"])
    return out


def closed_form_per_layer(family, hf, layers: dict, source: int, target: int, num_labels) -> dict:
    """Forward matrix FLOPs per row of one sub-block of each stack, and of the head, from the
    family's closed form of the whole model (each stack's parts over its layer count)."""
    parts = family.matmul_flops(hf, 1, source, num_labels, target)
    out = {stack: {sub: sum(parts[p] for p in names) // layers[stack] for sub, names in subs.items()}
           for stack, subs in CLOSED_PARTS.items()}
    out["head"] = parts.get("lm_head", parts.get("classifier", 0))
    out["xatt_memory"] = parts["cross_kv"] // layers["decoder"]
    return out


def _by_heads(model) -> int:
    """Parameters outside the layers split by heads like ATT (T5's position bias tables; in "other")."""
    return sum(p.numel() for name in getattr(model, "att_params", ()) for p in getattr(model, name).parameters())


def profile_encdec_model(cfg, num_labels: int | None) -> dict:
    """The version-2 model profile of cfg's encoder-decoder (see the module docstring); cfg.task
    picks the head (null: the LM's), num_labels the classifier's outputs."""
    from galaxy.profiler.cli import synthetic_batch
    from galaxy.profiler.profile import profile_model as profiler_run

    source, target = cfg.pad_size, target_tokens(cfg)
    hf = load_hf_config(cfg.model_path, cfg.dropout)
    family = family_of(hf.model_type)
    task = cfg.task or next(iter(family.tasks))
    num_labels = num_labels if task == "classification" else None
    bench = EncDecBench(cfg.model_path, source=source, target=target, task=task, num_labels=num_labels,
                        dropout=cfg.dropout)
    with open(os.path.join(cfg.model_path, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    with torch.device("meta"):
        whole = model_class(family, task)(hf, num_labels=num_labels)
    layers = {"encoder": whole.encoder_layers, "decoder": len(whole.layers) - whole.encoder_layers}
    batch = synthetic_batch(bench.task, 1, source, hf.vocab_size, num_labels, cfg.seed, "cpu", target=target)
    report = profiler_run(bench.model, batch, repeats=0)
    stacks = {stack: _stack_section(bench, stack, layers[stack], report) for stack in ("encoder", "decoder")}
    method = encdec_method_section(cfg, hf, bench.task, num_labels, source, target)
    closed = closed_form_per_layer(family, hf, layers, source, target, num_labels)
    # XATT's K/V projections of the memory: every rank runs them whole under XATT SP
    stacks["decoder"]["flops_per_row"]["xatt"]["fwd_memory"] = closed["xatt_memory"]
    head_fwd = closed["head"]
    measured = {stack: {sub: f["fwd"] for sub, f in stacks[stack]["flops_per_row"].items() if sub != "con"}
                for stack in stacks}
    embed_acts = bench.saved_bytes("ends", "embed", source, ROWS) / ROWS
    head_acts = linear(lambda u: bench.saved_bytes("ends", "head", u, ROWS) / ROWS, _half(target), target)
    return {
        "format": FORMAT, "version": VERSION, "encoder_decoder": True,
        "model_path": cfg.model_path, "model_type": hf.model_type, "family": family.name, "task": bench.task,
        "num_labels": num_labels, "pad_size": source, "target_pad_size": target, "dropout": cfg.dropout,
        "hf_config": raw, "carry_tensors": bench.model.carry_size,
        "units": {"embed": [source, source], "head": [target, 1]},
        "params": {**part_counts(whole), "by_heads": _by_heads(whole)},
        "act_bytes_per_row": {"embed": [embed_acts, 0.0], "head": head_acts},
        "flops_per_row": {"head": {"fwd": head_fwd, "bwd": 2 * head_fwd, "fwd_elementwise": 0, "bwd_elementwise": 0}},
        "stacks": stacks,
        "profiler": {"layer_fwd_flops_per_row": measured,
                     "closed_form_layer_fwd_flops_per_row": {s: {k: closed[s][k] for k in measured[s]} for s in stacks},
                     "flops_match_closed_form": all(measured[s][k] == closed[s][k] for s in stacks for k in measured[s])},
        **({"peft": method} if method else {}),
    }


def summary(doc: dict) -> str:
    """profile-model's line about a version-2 profile."""
    stacks, p = doc["stacks"], doc["params"]
    per_layer = ", ".join(f"{s['layers']} {name} layers of {s['per_layer']:,}" for name, s in stacks.items())
    return (f"{doc['family']} {doc['model_type']}: {p['total']:,} parameters ({per_layer}) at {doc['pad_size']} "
            f"source and {doc['target_pad_size']} target tokens; each sub-block's forward FLOPs per row "
            f"{'equal to' if doc['profiler']['flops_match_closed_form'] else 'DIFFER from'} the closed form")
