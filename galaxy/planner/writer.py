"""The searched plan as a train_config JSON that pretrain_galaxy.py / finetune_llama.py run unchanged.

The base config's keys are carried over as written (data, optimizer, steps, paths: relative paths
stay relative to the directory training starts in, as in the base); the plan's keys
(galaxy.plan.Plan.to_keys) replace any the base had, and a split the plan does not use is left out.
"_planned" (ignored by galaxy.config, as every key starting with "_") records what the search
predicted. The file is checked with galaxy.config's own validation for the world it was planned
for before the search reports it.
"""
from __future__ import annotations

import json
import os

from galaxy.config import apply_preset, load_config, validate_for_world
from galaxy.files import write_json_atomic
from galaxy.plan import FIELD_OF_KEY
from galaxy.planner.cost import Estimate


def planned_config(base: dict, est: Estimate, layers: int, budgets) -> dict:
    # The search chooses every plan key but the overlap options, which stay as the base has them.
    chosen = {k for k, name in FIELD_OF_KEY.items() if name not in ("comm_chunks", "kv_blocks")}
    out = {k: v for k, v in base.items() if k not in chosen and k != "_planned"}
    out.update({k: v for k, v in est.plan.to_keys(layers).items() if k in chosen})
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
