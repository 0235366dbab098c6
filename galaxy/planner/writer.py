"""The searched plan as a train_config JSON that pretrain_galaxy.py / finetune_llama.py run unchanged.

The base config's keys are carried over as written (data, optimizer, steps, paths: relative paths
stay relative to the directory training starts in, as in the base); the plan's keys
(galaxy.plan.Plan.to_keys) replace any the base had, and a split the plan does not use is left out.
"_planned" (ignored by galaxy.config, as every key starting with "_") records what the search
predicted; `ranked_document` is the same record for every plan that fits (plan.py search --json). The file is checked with galaxy.config's own validation for the world it was planned
for before the search reports it.
"""
from __future__ import annotations

import json
import os

from galaxy.config import apply_preset, load_config, validate_for_world
from galaxy.files import write_json_atomic
from galaxy.plan import FIELD_OF_KEY
from galaxy.planner.cost import Estimate


# The search chooses every plan key (batch_streams and comm_chunks too: galaxy.planner.overlap_time)
# but kv_blocks, which stays as the base has it.
CHOSEN = frozenset(k for k, name in FIELD_OF_KEY.items() if name != "kv_blocks")


def plan_keys(est: Estimate, layers: int) -> dict:
    """The plan's keys as the written config has them."""
    return {k: v for k, v in est.plan.to_keys(layers).items() if k in CHOSEN}


def prediction(est: Estimate, trainable: int) -> dict:
    """What the search predicted for a plan (the written config's "_planned" names)."""
    return {"predicted_step_s": round(est.step_s, 6),
            "predicted_memory_mib": [round(m, 1) for m in est.memory_mib],
            "sent_bytes_per_step": est.sent_bytes, "trainable_parameters": trainable}


def planned_config(base: dict, est: Estimate, layers: int, budgets, trainable: int) -> dict:
    out = {k: v for k, v in base.items() if k not in CHOSEN and k != "_planned"}
    out.update(plan_keys(est, layers))
    out["_planned"] = {"by": "plan.py search", "world": len(est.memory_mib), **prediction(est, trainable),
                       "memory_budget_mib": [round(b, 1) for b in budgets]}
    return out


def ranked_document(result, layers: int, trainable: int) -> dict:
    """plan.py search --json: the plans that fit, best first, as {"keys", and the prediction}; when
    none fits, every rank's shortfall under the leanest plan instead (MiB over its budget)."""
    if result.ranked:
        return {"plans": [{"keys": plan_keys(e, layers), **prediction(e, trainable)} for e in result.ranked]}
    lean = result.leanest
    return {"shortfall_mib": None if lean is None else [round(x, 1) for x in lean.shortfall(result.budgets)],
            "memory_budget_mib": [round(b, 1) for b in result.budgets],
            "leanest": None if lean is None else {"keys": plan_keys(lean, layers), **prediction(lean, trainable)}}


def write_planned_config(base_path: str, est: Estimate, out_path: str, *, shape: dict, budgets,
                         trainable: int) -> dict:
    """Write the plan over the base config to out_path and check it as training will; returns it."""
    with open(base_path, encoding="utf-8") as f:
        base = json.load(f)
    doc = planned_config(base, est, shape["num_hidden_layers"], budgets, trainable)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    write_json_atomic(out_path, doc)
    check_written(out_path, len(est.memory_mib), shape)
    return doc


def check_written(path: str, world: int, shape: dict) -> None:
    """galaxy.config's checks of the written file, for every rank of the world (ConfigError)."""
    cfg = apply_preset(load_config(path), "galaxy", None, world)
    for rank in range(world):
        validate_for_world(cfg, world, rank, shape)
