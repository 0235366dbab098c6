"""The layout record a checkpoint keeps: what this run's random streams depend on, from its plan.

Sharded dropout streams depend on the whole layout (world, methods, shares, device); each stage's
replicated stream on the stages' layer ranges (galaxy/train/rng_state.py). A resume compares the
saved record with the run's own to decide which streams continue and which are drawn afresh.
"""
from __future__ import annotations

from galaxy.plan import Plan

# The plan's fields that place shards on ranks (the rest, e.g. micro-batches or overlap options,
# do not move a random stream).
PLACING = ("att", "mlp", "con", "pp", "dp", "heads", "columns", "tokens")
# An encoder-decoder's too (absent from other models' records, as from older checkpoints').
PLACING_DECODER = ("xatt", "decoder_tokens")


def layout_record(plan: Plan, world: int, device: str) -> dict:
    """The record of a resolved plan on `world` ranks of device type `device`."""
    placing = {name: list(v) if isinstance(v := getattr(plan, name), tuple) else v for name in PLACING
               + tuple(n for n in PLACING_DECODER if getattr(plan, n) is not None)}
    return {"world": world, "device": device, "plan": placing,
            "stages": [[r.start, r.stop] for r in plan.stage_layers()]}


def saved_layout(record: dict, num_hidden_layers: int) -> dict:
    """A checkpoint's record in today's form. Older checkpoints wrote the methods as a list, the
    shares as heads / intermediate / seq, and the pipeline as pp_deg / dp_deg / stages (or, before
    pipelines could save, nothing: a pp 1 run)."""
    if "stages" in record:
        return record
    pipeline = record.get("pipeline") or {"pp_deg": 1, "dp_deg": record["world"] // len(record["seq"]),
                                          "stages": [[0, num_hidden_layers]]}
    att, mlp, con = record["plan"]
    placing = {"att": att, "mlp": mlp, "con": con, "pp": pipeline["pp_deg"], "dp": pipeline["dp_deg"],
               "heads": record["heads"], "columns": record["intermediate"], "tokens": record["seq"]}
    return {"world": record["world"], "device": record["device"], "plan": placing, "stages": pipeline["stages"]}
