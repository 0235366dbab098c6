"""Seconds of a decode step's pieces on one device, and of its one-token calls on the link, for the
latency cost model (galaxy.planner.latency_cost).

From the device profile's "decode" section where profile-devices --objective latency measured one
(galaxy.planner.decode_profile: real one-token steps, operators' and Python's time included),
else from matrix FLOPs over the device's one-token rate (decode_flops_per_s, or the GEMM rate):
products only, which under-counts a step (bench/results/latency_cluster.md: 36.4 tokens/s
predicted that way, 18.8 measured).

ATT at a share is a line in the keys it attends to: the measured step at the profile's `keys`
plus 4 x heads_r x head_dim FLOPs per key more or fewer, at the one-token rate (a cached key is
read once per step, as a weight is).
"""
from __future__ import annotations

from galaxy.planner.device_compute import _interp as _line
from galaxy.planner.link_model import _interpolate
from galaxy.planner.profiles import ProfileError

# a greedy row's pick of the split LM head (galaxy.inference.split_head.greedy_tokens): its best
# logit and index, [1, 2] float64, exchanged as a one-token call
PICK_BYTES = 16


class DecodeTimes:
    """One device's decode pieces: att_line(heads_r) -> (seconds at no keys, seconds per key),
    mlp(columns_r), con(), glue() per layer, head(vocab rows), embed(), sampler()."""

    def __init__(self, device: dict, flops: dict, heads: int, head_dim: int, columns: int, vocab: int,
                 where: str = "device"):
        """flops: one token's matrix FLOPs of whole sub-blocks {"att", "mlp", "con", "head"}."""
        self.flops, self.heads, self.head_dim, self.columns, self.vocab = flops, heads, head_dim, columns, vocab
        self.rate = device.get("decode_flops_per_s") or device["gemm_flops_per_s"]
        self.table = device.get("decode")
        if self.table is not None:
            for key in ("att_tp", "mlp_tp", "head"):
                t = self.table.get(key)
                if not isinstance(t, dict) or len(t.get("units") or ()) != len(t.get("s") or ()) or not t["units"]:
                    raise ProfileError(f"{where} decode: '{key}' must hold 'units' and 's' of one length")
            for key in ("keys", "con_s", "layer_s", "embed_s", "sampler_s"):
                if not isinstance(self.table.get(key), (int, float)):
                    raise ProfileError(f"{where} decode: '{key}' must be a number; profile-devices --objective "
                                       f"latency writes it")

    @property
    def measured(self) -> bool:
        return self.table is not None

    def att_line(self, heads_r: int) -> tuple[float, float]:
        """(seconds of ATT at heads_r query heads with no key cached, seconds per cached key)."""
        per_key = 4 * heads_r * self.head_dim / self.rate
        if self.table is None:
            return self.flops["att"] * heads_r / self.heads / self.rate, per_key
        t = self.table["att_tp"]
        at_keys = _line(t["units"], t["s"], heads_r)
        return max(0.0, at_keys - per_key * self.table["keys"]), per_key

    def _share(self, flops_key: str, table_key: str, units: int, whole: int) -> float:
        """Seconds of a sub-block holding `units` of its `whole` (columns, vocabulary rows): the
        measured line where the profile has one, else its FLOPs at the GEMM rate."""
        if self.table is None:
            return self.flops[flops_key] * units / whole / self.rate
        t = self.table[table_key]
        return max(0.0, _line(t["units"], t["s"], units))

    def mlp(self, columns_r: int) -> float:
        return self._share("mlp", "mlp_tp", columns_r, self.columns)

    def con(self) -> float:
        return self.flops["con"] / self.rate if self.table is None else self.table["con_s"]

    def glue(self) -> float:
        """What a whole layer's step takes beyond its sub-blocks (the layer steps' and transitions'
        Python), at the profile's keys: never below 0."""
        if self.table is None:
            return 0.0
        at, per_key = self.att_line(self.heads)
        parts = at + per_key * self.table["keys"] + self.mlp(self.columns) + 2 * self.con()
        return max(0.0, self.table["layer_s"] - parts)

    def layer_pass(self, heads_r: int, columns_r: int) -> float:
        """A layer's one-token step at these shares with no key cached: what any pass of the layer
        costs whatever its tokens (its weights read from memory once, its Python). A prefill chunk
        pays it (galaxy.planner.chunked_prefill)."""
        return self.att_line(heads_r)[0] + self.mlp(columns_r) + 2 * self.con() + self.glue()

    def head(self, rows: int) -> float:
        """The LM head (final norm and product) on one token for `rows` vocabulary rows."""
        return self._share("head", "head", rows, self.vocab)

    def embed(self) -> float:
        return 0.0 if self.table is None else self.table["embed_s"]

    def sampler(self) -> float:
        return 0.0 if self.table is None else self.table["sampler_s"]


def vocab_split(vocab: int, columns) -> list[int]:
    """Vocabulary rows per rank of a decode step's split head: in proportion to the MLP columns,
    rounded at the boundaries as galaxy.inference.split_head.vocab_shares rounds them."""
    total, bounds = sum(columns), [0]
    for i in range(1, len(columns) + 1):
        bounds.append(round(vocab * sum(columns[:i]) / total))
    return [b - a for a, b in zip(bounds, bounds[1:])]


def token_call_time(link: dict | None, kind: str, n: int, wire: float) -> float | None:
    """One measured one-token call ("token_sum", "broadcast") over n ranks moving `wire` bytes:
    read off the link's measured points of that kind (its group of n, else the largest group
    measured: a one-token call costs its one round of messages); None where none were measured."""
    rows = [m for m in (link or {}).get("measured") or () if m.get("kind") == kind]
    if not rows:
        return None
    groups = {m["group"] for m in rows}
    group = n if n in groups else max(groups)
    by_size: dict[int, list[float]] = {}
    for m in rows:
        if m["group"] == group:
            by_size.setdefault(int(m["bytes"]), []).append(float(m["seconds"]))
    sizes = sorted(by_size)
    seconds = [sum(by_size[b]) / len(by_size[b]) for b in sizes]
    return _interpolate(sizes, seconds, wire, link["fit"]["all_gather"]["bytes_per_s"])
