"""profile-model's "peft" section: the base config's fine-tuning method, measured on the model
galaxy.peft makes of it, as galaxy.planner.model_profile measures the model itself.

    "peft": {"signature": {...},                       # galaxy.planner.method: what the cost depends on
             "description": str, "backbone": "frozen" | "forward" | "absent",
             "params": {"embed", "head", "tied", "other", "total",
                        "layer": {"att_tp": [c0, c1], "mlp_tp": [c0, c1], "att_sp": n, "mlp_sp": n,
                                  "con": n, "side": n}},   # every parameter held, the method's own too
             "trainable": {...the same keys...},         # those that train
             "summed_outside": {"embed", "head", "other"},   # trained outside the layers on the CON
                                                          # layout: summed over the group under CON SP
             "act_bytes_per_row": {kind: [c0, c1]},       # what the method keeps for backward
             "side_width": w,                             # the side state's width (side methods; else 0)
             "side_flops_per_row": {"fwd", "bwd"}}        # the side block's matrix FLOPs (side methods)

The per-layer figures come from the one-layer model with the method applied
(galaxy.planner.harness); those outside the layers from the whole model built on the meta device
with the method applied after a two-rank Galaxy plan (CON SP), whose rules say which trained
parameters the group sums.
"""
from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from galaxy.distributed.group import GalaxyGroup
from galaxy.models.build import model_class
from galaxy.models.registry import family_of
from galaxy.parallel.plan import apply_plan
from galaxy.peft import PeftOptions, apply_peft
from galaxy.plan import Plan, even_split
from galaxy.planner.counting import linear, part_counts
from galaxy.planner.harness import SubBlockBench
from galaxy.planner.method import BACKBONE, costed_options, describe, method_signature

ROWS = 2     # as model_profile: bytes measured on 2 rows and divided


def method_section(cfg, num_labels: int | None, hf) -> dict | None:
    """The "peft" section for cfg's method (None under full fine-tuning); hf: the model's config."""
    options = PeftOptions.from_config(cfg)
    if options.method == "full":
        return None
    seq = cfg.pad_size
    family = family_of(hf.model_type)
    options = costed_options(options, family)
    bench = SubBlockBench(cfg.model_path, seq=seq, num_labels=num_labels, dropout=cfg.dropout, seed=cfg.seed,
                          peft=options)
    signature = method_signature(options, family)
    params, trainable, summed = _outside_counts(hf, num_labels, seq, options, cfg.seed)
    for counts, trained in ((params, False), (trainable, True)):
        counts["layer"] = _layer_counts(bench, trained=trained)
        counts["total"] = _whole_model(counts, bench, hf.num_hidden_layers)
    acts = {}
    for kind in bench.kinds:
        total, step = bench.units[kind]
        lo = total if kind == "embed" else max(step, total // 2 // step * step)
        acts[kind] = [v / ROWS for v in linear(lambda u: bench.saved_bytes(kind, u, ROWS), lo, total)]
    side = options.method in ("side", "side_only")
    return {"signature": signature, "description": describe(signature), "backbone": BACKBONE[options.method],
            "params": params, "trainable": trainable, "summed_outside": summed, "act_bytes_per_row": acts,
            "side_width": bench.model.side_width if side else 0,
            "side_flops_per_row": matmul_flops(bench, "side", seq) if side else None}


def _layer_counts(bench: SubBlockBench, *, trained: bool) -> dict:
    """One layer's parameters per kind: held, or (trained) those that train."""
    seq, count = bench.seq, bench.trainable if trained else bench.params
    att_total, att_step = bench.units["att_tp"]
    layer = bench.layer
    con = [p for m in (layer.con1, layer.con2) for p in m.parameters()]
    side = list(layer.side.parameters()) if isinstance(getattr(layer, "side", None), torch.nn.Module) else []
    keep = (lambda p: p.requires_grad) if trained else (lambda p: True)
    return {"att_tp": linear(lambda u: count("att_tp", u), att_step, att_total),
            "mlp_tp": linear(lambda u: count("mlp_tp", u), 1, bench.units["mlp_tp"][0]),
            "att_sp": count("att_sp", seq), "mlp_sp": count("mlp_sp", seq),
            "con": sum(p.numel() for p in con if keep(p)), "side": sum(p.numel() for p in side if keep(p))}


def _whole_model(counts: dict, bench: SubBlockBench, layers: int) -> int:
    """The whole model's count: every layer unsharded, and the parts outside the layers once."""
    layer = counts["layer"]
    at = lambda kind: layer[kind][0] + layer[kind][1] * bench.units[kind][0]   # noqa: E731
    per_layer = at("att_tp") + at("mlp_tp") + layer["con"] + layer["side"]
    return round(layers * per_layer + counts["embed"] + counts["head"] + counts["other"] - counts["tied"])


def _outside_counts(hf, num_labels, seq: int, options: PeftOptions, seed: int, *, task: str | None = None,
                    target: int | None = None, columns: int | None = None,
                    plan: Plan = Plan.preset("galaxy")) -> tuple[dict, dict, dict]:
    """(held, trained, trained and summed under CON SP) outside the layers, on the meta device
    (the layers are sharded there: their counts come from the one-layer bench). An
    encoder-decoder's: its task's model, target tokens split too, columns its MLP width, and a plan
    (CON SP) that leaves whole what T5 splits by heads beside the layers."""
    family = family_of(hf.model_type)
    with torch.device("meta"):
        model = model_class(family, task)(hf, num_labels=num_labels)
    group = GalaxyGroup(0, 2, None, tuple(even_split(hf.num_attention_heads, 2, _kv_group(hf))),
                        tuple(even_split(columns or hf.intermediate_size, 2)), tuple(even_split(seq, 2)),
                        tuple(even_split(target, 2)) if target else None)
    apply_plan(model, plan, group)
    apply_peft(model, options, seed=seed)
    rules = model.attached.rules
    held = part_counts(model)
    trained = part_counts(model, lambda n, p: p.requires_grad)
    summed = part_counts(model, lambda n, p: p.requires_grad and rules[n].kind == "sum")
    return held, trained, {k: summed[k] for k in ("embed", "head", "other")}


def _kv_group(hf) -> int:
    return hf.num_attention_heads // (getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads)


def matmul_flops(bench: SubBlockBench, kind: str, units: int) -> dict:
    """{"fwd", "bwd"}: matrix FLOPs per row of one forward and backward of `kind` at `units`
    (torch's FLOP counter; one row)."""
    return thunk_flops(bench.prepare(kind, units, 1)[1])


def thunk_flops(fwd) -> dict:
    """{"fwd", "bwd"}: matrix FLOPs of fwd() and of a backward from all its outputs that need one."""
    with FlopCounterMode(display=False) as f:
        out = fwd()
    forward = f.get_total_flops()
    outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o.requires_grad]
    with FlopCounterMode(display=False) as b:
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    return {"fwd": forward, "bwd": b.get_total_flops()}
