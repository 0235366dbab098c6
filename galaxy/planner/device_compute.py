"""Seconds a device spends on a sub-block at a share: from its measured compute table when the table
was taken for this model and pad_size, else from the model profile's FLOPs and the device's GEMM rate.

Under a PEFT method the table is the one profile-devices measured for that method (the device
profile's compute "peft", when its signature is the run's): the sub-blocks as galaxy.peft makes
them, frozen weights and all. Without one, the full fine-tuning table stands in (weight gradients
counted: an upper bound), a backbone that runs without autograd takes no backward, frozen
embeddings none either, and the side block is timed by its FLOPs."""
from __future__ import annotations

import bisect

from galaxy.planner.method import BACKBONE

LAYER_KINDS = ("att_tp", "att_sp", "mlp_tp", "mlp_sp", "con")


def _interp(xs, ys, x):
    """Piecewise linear through (xs, ys), extended linearly past both ends; one point: constant."""
    if len(xs) == 1:
        return ys[0]
    i = bisect.bisect_left(xs, x)
    i = min(max(i, 1), len(xs) - 1)
    x0, x1 = xs[i - 1], xs[i]
    return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - x0) / (x1 - x0)


class DeviceCompute:
    """Seconds one device spends on a sub-block kind at a share: its measured table when the
    profile has one for this model, else the model profile's FLOPs over its GEMM rate."""

    FLOPS_OF = {"att_tp": "att", "att_sp": "att", "mlp_tp": "mlp", "mlp_sp": "mlp", "con": "con",
                "head": "head", "embed": None}

    def __init__(self, device: dict, model: dict, use_tables: bool, method: dict | None = None):
        """method: the model profile's "peft" section of the run's method (None: full fine-tuning)."""
        self.device, self.model, self.method = device, model, method
        compute = device.get("compute") if use_tables else None
        self.tables = compute["kinds"] if compute else {}
        self.rows = compute["rows"] if compute else []
        self.backbone = BACKBONE[method["signature"]["method"]] if method else "trained"
        peft = (compute or {}).get("peft")
        self.method_tables = bool(method and peft and peft.get("signature") == method["signature"])
        if self.method_tables:
            self.tables, self.rows = peft["kinds"], peft["rows"]
        self.rate = device.get("gemm_flops_per_s")
        self.ew_rate = device.get("elementwise_flops_per_s")
        self._cache: dict = {}

    def __call__(self, kind: str, units: int, rows: float) -> tuple[float, float]:
        key = (kind, units, rows)
        hit = self._cache.get(key)
        if hit is None:
            if kind in self.tables:
                hit = self._table(kind, units, rows)
            elif kind == "side":
                hit = self._side_flops(units, rows)
            else:
                hit = self._flops(kind, units, rows)
            hit = self._cache[key] = self._standing_in(kind, *hit)
        return hit

    def rows_in_place(self, units: int, rows: float) -> tuple[float, float]:
        """The word embedding's backward when its rows accumulate in place (galaxy.parallel.
        embedding_grad): (seconds once a step, seconds per micro-batch). The table times a fresh
        dense gradient, a zeroed [vocab, hidden] block plus the rows added into it: its backward
        at rows -> 0 (extended linearly through the measured rows) stands for the zeroing, paid
        once for the step's .grad, the rest for the rows each micro-batch adds. A one-row table
        (proportional in rows) has no such intercept: all of it stays per micro-batch."""
        _, bwd = self(kind="embed", units=units, rows=rows)
        if "embed" not in self.tables or len(self.rows) < 2:
            return 0.0, bwd
        zero = min(max(self._standing_in("embed", *self._table("embed", units, 0.0))[1], 0.0), bwd)
        return zero, bwd - zero

    def _standing_in(self, kind: str, fwd: float, bwd: float) -> tuple[float, float]:
        """What a full fine-tuning figure standing in for a method's keeps: no backward where the
        method runs none (a backbone without autograd, frozen embeddings)."""
        if self.backbone == "trained" or self.method_tables:
            return fwd, bwd
        if kind == "embed" or (kind in LAYER_KINDS and self.backbone in ("forward", "absent")):
            return fwd, 0.0
        return fwd, bwd

    def _side_flops(self, units, rows):
        f = (self.method or {}).get("side_flops_per_row")
        if not f or self.rate is None:
            return 0.0, 0.0
        frac = units / self.model["pad_size"]
        return f["fwd"] / self.rate * rows * frac, f["bwd"] / self.rate * rows * frac

    def _table(self, kind, units, rows):
        t = self.tables[kind]
        out = []
        for grid in (t["fwd_s"], t["bwd_s"]):
            per_unit = [self._at_rows(row, rows) for row in grid]
            out.append(max(0.0, _interp(t["units"], per_unit, units)))
        return tuple(out)

    def _at_rows(self, row: list, rows: float) -> float:
        """A unit's seconds at `rows` from its measured rows: piecewise linear through two or more;
        one (a --quick profile, taken at the config's batch) is in proportion to the rows, as the
        FLOPs are (held constant, a batch-8 profile costed batch 2 at batch 8's compute)."""
        if len(self.rows) == 1:
            return row[0] * rows / self.rows[0]
        return _interp(self.rows, row, rows)

    def _flops(self, kind, units, rows):
        name = self.FLOPS_OF[kind]
        if name is None or self.rate is None:
            return 0.0, 0.0
        f = self.model["flops_per_row"][name]
        total = self.model["units"][kind][0]
        frac = 1.0 if kind == "head" and self.model["task"] == "classification" else units / total
        ew = self.ew_rate
        fwd = f["fwd"] / self.rate + (f["fwd_elementwise"] / ew if ew else 0.0)
        bwd = f["bwd"] / self.rate + (f["bwd_elementwise"] / ew if ew else 0.0)
        return fwd * rows * frac, bwd * rows * frac


def model_signature(model: dict) -> dict:
    """What a device's compute table must have been measured at to apply to this model."""
    hf = model["hf_config"]
    return {"model_type": hf.get("model_type"), "hidden_size": hf.get("hidden_size"),
            "num_attention_heads": hf.get("num_attention_heads"),
            "num_key_value_heads": hf.get("num_key_value_heads") or hf.get("num_attention_heads"),
            "intermediate_size": hf.get("intermediate_size"), "vocab_size": hf.get("vocab_size"),
            "pad_size": model["pad_size"]}


def tables_match(device: dict, signature: dict) -> bool:
    compute = device.get("compute")
    return bool(compute) and all(compute.get("model", {}).get(k) == v for k, v in signature.items())
