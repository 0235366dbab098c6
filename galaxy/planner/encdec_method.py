"""The "peft" section of an encoder-decoder's model profile (version 2): the base config's
fine-tuning method, measured on the two layers galaxy.peft makes of one encoder and one decoder
layer (galaxy.planner.encdec_bench with peft=), as galaxy.planner.method_profile measures it for
the other families.

    "peft": {"signature", "description", "backbone",      # galaxy.planner.method
             "params": {"embed", "head", "tied", "other", "total"},     # outside the layers, held
             "trainable": {...the same keys...},                        # ... that train
             "summed_outside": {"embed", "head", "other"},  # trained on the CON layout: summed under CON SP
             "side_width": w,                               # the side state's width (side methods; else 0)
             "head_flops_per_row": {"fwd", "bwd"},          # the head under the method (a frozen head:
                                                            # no weight gradient)
             "stacks": {"encoder" | "decoder": {
                 "params": {kind: [c0, c1] | n, "con": n, "side": n},   # held (side: one side layer)
                 "trainable": {...the same keys...},
                 "act_bytes_per_row": {kind: [c0, c1]},     # what the method saves (side: the side
                                                            # layer at u CON tokens; a backbone run
                                                            # without autograd saves nothing)
                 "flops_per_row": {"att" | "mlp" | "con" [| "xatt"] [| "side"]: {"fwd", "bwd"}},
                 "full_flops_per_row": {...}}}}              # the same count under full fine-tuning

Kinds as the stack's own section (att_tp ... con); "con" is every CON of a layer (the decoder's
three; adapters sit in CON1 and CON2, none in the cross-attention's CONX). FLOPs are torch's count
of matrix products at the whole share, forward and the backward the method runs: a frozen
projection's input gradient only, LoRA's rank-r products and their weight gradients, none for a
backbone run without autograd. torch's counter misses what its CPU attention kernel computes, so
the cost model takes the method's difference to the same count under full fine-tuning
("full_flops_per_row") and applies it to the stack's own figures (the closed forms).
"""
from __future__ import annotations

import torch

from galaxy.models.build import model_class
from galaxy.models.registry import family_of
from galaxy.peft import PeftOptions
from galaxy.plan import Plan
from galaxy.planner.counting import linear
from galaxy.planner.encdec_bench import STACK_KINDS, STACKS, EncDecBench
from galaxy.planner.encdec_terms import count
from galaxy.planner.method import BACKBONE, costed_options, describe, method_signature
from galaxy.planner.method_profile import _outside_counts, thunk_flops

ROWS = 2     # activation bytes are measured on 2 rows and divided (they are linear in rows)
SUB_KIND = {"att": "att_tp", "mlp": "mlp_tp", "xatt": "xatt_tp", "con": "con", "side": "side"}


def _half(total: int) -> int:
    return max(1, total // 2)


def encdec_method_section(cfg, hf, task: str, num_labels: int | None, source: int, target: int) -> dict | None:
    """The section for cfg's method (None under full fine-tuning); hf: the model's config."""
    options = PeftOptions.from_config(cfg)
    if options.method == "full":
        return None
    family = family_of(hf.model_type)
    options = costed_options(options, family)
    bench = EncDecBench(cfg.model_path, source=source, target=target, task=task, num_labels=num_labels,
                        dropout=cfg.dropout, seed=cfg.seed, peft=options)
    signature = method_signature(options, family)
    held, trained, summed = _outside_counts(hf, num_labels, source, options, cfg.seed, task=task, target=target,
                                            columns=bench.columns, plan=Plan(att="SP", mlp="SP", con="SP"))
    full = EncDecBench(cfg.model_path, source=source, target=target, task=task, num_labels=num_labels,
                       dropout=cfg.dropout, seed=cfg.seed)
    side = not bench.backbone_grad
    head = thunk_flops(bench.prepare_end("head", target, 1)[1])
    stacks = {stack: {**_stack(bench, stack), "full_flops_per_row": _flops(full, stack)} for stack in STACKS}
    layers = _layer_counts(hf)
    for counts, key in ((held, "params"), (trained, "trainable")):
        counts["total"] = _whole_model(counts, {s: stacks[s][key] for s in STACKS}, bench.units, layers)
    return {"signature": signature, "description": describe(signature), "backbone": BACKBONE[options.method],
            "params": held, "trainable": trained, "summed_outside": summed,
            "side_width": bench.model.side_width if side else 0, "head_flops_per_row": head, "stacks": stacks}


def _layer_counts(hf) -> dict:
    """Each stack's layers, as the family's model builds them (a meta model)."""
    with torch.device("meta"):
        model = model_class(family_of(hf.model_type), None)(hf)
    return {"encoder": model.encoder_layers, "decoder": len(model.layers) - model.encoder_layers}


def _whole_model(outside: dict, stacks: dict, units: dict, layers: dict) -> int:
    """The whole model's count: each stack's layers unsharded, the parts outside them once."""
    total = outside["embed"] + outside["head"] - outside["tied"] + outside.get("other", 0)
    for stack, counts in stacks.items():
        whole = sum(count(v, units[stack][kind][0]) for kind, v in counts.items() if kind.endswith("_tp"))
        total += layers[stack] * (whole + counts["con"] + counts["side"])
    return round(total)


def _stack(bench: EncDecBench, stack: str) -> dict:
    units = bench.units[stack]
    kinds = STACK_KINDS[stack] + (("side",) if "side" in units else ())
    counts = {}
    for trained in (False, True):
        count = bench.trainable if trained else bench.params
        out = {}
        for kind in kinds:
            total = units[kind][0]
            f = lambda u, kind=kind: count(stack, kind, u)           # noqa: E731
            out[kind] = linear(f, _half(total), total) if kind.endswith("_tp") else f(total)
        out["con"] = bench.con_params(stack, trained)
        out.setdefault("side", 0)
        counts[trained] = out
    acts = {kind: linear(lambda u, kind=kind: bench.saved_bytes(stack, kind, u, ROWS) / ROWS,
                         _half(units[kind][0]), units[kind][0]) for kind in kinds}
    return {"params": counts[False], "trainable": counts[True], "act_bytes_per_row": acts,
            "flops_per_row": _flops(bench, stack)}


def _flops(bench: EncDecBench, stack: str) -> dict:
    """sub-block -> {"fwd", "bwd"}: torch's count of one row at the whole share."""
    units = bench.units[stack]
    subs = ("att", "mlp", "con") + (("xatt",) if stack == "decoder" else ()) + (("side",) if "side" in units else ())
    return {sub: thunk_flops(bench.prepare(stack, SUB_KIND[sub], units[SUB_KIND[sub]][0], 1)[1]) for sub in subs}
