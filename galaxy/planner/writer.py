"""The searched plan as a train_config JSON that pretrain_galaxy.py / finetune_llama.py run unchanged.

The base config's keys are carried over as written (data, optimizer, steps, paths: relative paths
stay relative to the directory training starts in, as in the base); the plan's keys replace any the
base had, and a split the plan does not use is left out. "_planned" (ignored by galaxy.config, as
every key starting with "_") records what the search predicted. The file is checked with
galaxy.config's own validation for the world it was planned for before the search reports it.
"""
from __future__ import annotations

import json
import os

from galaxy.config import apply_preset, load_config, validate_for_world
from galaxy.files import write_json_atomic
from galaxy.planner.cost import Estimate, Plan

PLAN_KEYS = ("att_parallel_method", "mlp_parallel_method", "con_parallel_method", "tp_num_attention_heads_list",
             "tp_intermediate_size_list", "seq_scatter_list", "pp_deg", "dp_deg", "stage_num_hidden_layers_list",
             "num_microbatches", "pipeline_schedule", "grad_accum_steps", "activation_checkpointing", "dp_sharding")


def checkpoint_value(plan: Plan, layers: int):
    """activation_checkpointing for the plan: "none", "full", a number of leading layers (no
    pipeline), or the layer indices (the leading layers of each stage)."""
    if not any(plan.checkpoint):
        return "none"
    if sum(plan.checkpoint) == layers:
        return "full"
    if plan.pp == 1:
        return plan.checkpoint[0]
    out, start = [], 0
    for n, c in zip(plan.stages, plan.checkpoint):
        out += list(range(start, start + c))
        start += n
    return out


def plan_keys(plan: Plan, layers: int) -> dict:
    g = plan.group
    keys = {"att_parallel_method": plan.att, "mlp_parallel_method": plan.mlp, "con_parallel_method": plan.con,
            "pp_deg": plan.pp, "dp_deg": plan.dp, "activation_checkpointing": checkpoint_value(plan, layers)}
    if g > 1 and plan.att == "TP":
        keys["tp_num_attention_heads_list"] = list(plan.heads)
    if g > 1 and plan.mlp == "TP":
        keys["tp_intermediate_size_list"] = list(plan.columns)
    if g > 1 and "SP" in (plan.att, plan.mlp, plan.con):
        keys["seq_scatter_list"] = list(plan.tokens)
    if plan.pp > 1:
        keys.update(stage_num_hidden_layers_list=list(plan.stages), num_microbatches=plan.microbatches,
                    pipeline_schedule=plan.schedule)
    elif plan.microbatches > 1:
        keys["grad_accum_steps"] = plan.microbatches
    if plan.dp > 1:
        keys["dp_sharding"] = plan.dp_sharding
    return keys


def planned_config(base: dict, est: Estimate, layers: int, budgets) -> dict:
    out = {k: v for k, v in base.items() if k not in PLAN_KEYS and k != "_planned"}
    out.update(plan_keys(est.plan, layers))
    out["_planned"] = {
        "by": "plan.py search", "world": len(est.memory_mib),
        "predicted_step_s": round(est.step_s, 6),
        "predicted_memory_mib": [round(m, 1) for m in est.memory_mib],
        "memory_budget_mib": [round(b, 1) for b in budgets],
        "sent_bytes_per_step": est.sent_bytes,
    }
    return out


def write_planned_config(base_path: str, est: Estimate, out_path: str, *, shape: dict, budgets) -> dict:
    """Write the plan over the base config to out_path and check it as training will; returns it."""
    with open(base_path, encoding="utf-8") as f:
        base = json.load(f)
    doc = planned_config(base, est, shape["num_hidden_layers"], budgets)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    write_json_atomic(out_path, doc)
    check_written(out_path, len(est.memory_mib), shape)
    return doc


def check_written(path: str, world: int, shape: dict) -> None:
    """galaxy.config's checks of the written file, for every rank of the world (ConfigError)."""
    cfg = apply_preset(load_config(path), "galaxy", None, world)
    for rank in range(world):
        validate_for_world(cfg, world, rank, shape)
