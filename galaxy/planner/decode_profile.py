"""profile-devices --objective latency: what one decode step of a causal LM costs on this device.

A decode step runs one token per row through every layer, reading each layer's KV cache
(galaxy.inference.engine). At one token a product reads its whole weight for one row, and the
operators' launch and Python time is a large part of the step (bench/results/latency_cluster.md:
one device decoded at 18.8 tokens/s where its products alone, at decode_flops_per_s, gave 36.4).
So the step is timed as it runs, on the one-layer model of galaxy.planner.harness, with a cache of
`keys` keys (the prefill's tokens):

  att_tp   the ATT module at u query heads (its TP shard; all heads: serial and SP ATT) on one
           token, through galaxy.layers.cached_attention: q, k, v projected, k, v appended, q over
           the cached keys, the output projection
  mlp_tp   the MLP at u columns on one token
  con      one connective on one token
  layer_s  the whole layer (ATT, CON, MLP, CON) through the model's run_layers, serially: what the
           layer's glue adds over its sub-blocks (the layer steps' Python) is layer_s minus their sum
  embed_s  the token's embedding and the layer context (rotary tables) a step builds
  head     the LM head's final norm and its product for u vocabulary rows on one token (a decode
           step splits it by rows over the last stage's group: galaxy.inference.split_head)
  sampler_s  the sampler's greedy choice from [1, vocab] logits

Under no_grad, in eval mode, as generation runs. Every point is timed in rounds like the compute
table (galaxy.planner.device_profile.measure_compute), `statistic` of its rounds kept.
"""
from __future__ import annotations

import statistics
import time

import torch

from galaxy.inference.sampling import Sampling, choose
from galaxy.layers.kv_cache import STEP_KEY, CacheStep, open_caches
from galaxy.plan import Plan

DECODE_POINTS = 3           # shares per split kind: the smallest, about half, all
MIN_ROUNDS, WINDOW_S = 5, 0.05   # rounds per point: at least 5, and until it has run WINDOW_S in all


def share_grid(total: int, step: int) -> list[int]:
    """A few shares from one step to the whole (multiples of step)."""
    units = total // step
    return sorted({step, max(1, units // 2) * step, total})


class DecodeBench:
    """One-token steps of the bench's one-layer model (a SubBlockBench) with a KV cache of `keys` keys."""

    def __init__(self, bench, keys: int):
        self.bench, self.keys, self.model = bench, keys, bench.model
        hf, dev = bench.hf, bench.device
        self.model.eval()
        self.x = torch.randn(1, 1, hf.hidden_size, device=dev)            # [b, 1, h]
        ones = torch.ones(1, 1, dtype=torch.long, device=dev)
        self.ids = torch.ones(1, 1, dtype=torch.long, device=dev)
        self.positions = torch.full((1, 1), keys, dtype=torch.long, device=dev)
        self.mask = ones
        self.context = {**self.model.layer_context(ones, self.positions), STEP_KEY: CacheStep(True, ones.bool())}
        self.caches = []

    def _cached(self, att):
        """att with a cache of `keys` filled keys."""
        att.kv_cache = att.start_cache(1, self.keys, 1, self.x.dtype, self.x.device)
        self._fill(att.kv_cache)
        return att

    def _fill(self, cache) -> None:
        """Random keys and values in every slot, all kept (values do not change the work)."""
        cache.k.normal_()
        cache.v.normal_()
        cache.keep.fill_(True)
        self.caches.append(cache)

    def _refill(self):
        for cache in self.caches:
            cache.length = self.keys          # the step appends one key: back to `keys` each run

    def runner(self, kind: str, units: int):
        """A function running one decode piece of `kind` at `units` (the whole model's share where
        the kind is not split)."""
        b, x, ctx = self.bench, self.x, self.context
        if kind == "att_tp":
            att = self._cached(b.module("att_tp", units))
            return lambda: att(x, **ctx)
        if kind == "mlp_tp":
            mlp = b.module("mlp_tp", units)
            return lambda: mlp(x)
        if kind == "con":
            layer = b.layer
            bias = getattr(layer.att, layer.att.deferred_bias.split(".")[0]).bias
            return lambda: layer.con1(x, bias, x)
        if kind == "layer":
            return self._layer_runner()
        if kind == "embed":
            m = self.model
            return lambda: (m.embed(self.ids, positions=self.positions), m.layer_context(self.mask, self.positions))
        if kind == "head":
            m, rows = self.model, slice(0, units)
            return lambda: m.vocab_slice_logits(m.head_input((x, x)), rows)
        if kind == "sampler":
            logits = torch.randn(1, b.hf.vocab_size, device=x.device)
            greedy = Sampling()
            return lambda: torch.tensor([choose(logits[0], greedy, None), 0])
        raise ValueError(f"unknown decode kind {kind!r}")

    def _layer_runner(self):
        """The whole layer through run_layers on a one-rank plan, its ATT cached."""
        from galaxy.distributed.group import GalaxyGroup
        from galaxy.parallel.plan import apply_plan
        m, hf = self.model, self.bench.hf
        if getattr(m, "attached", None) is None:
            apply_plan(m, Plan(), GalaxyGroup.serial(hf.num_attention_heads, hf.intermediate_size, self.bench.seq))
        caches = open_caches(m, 1, self.keys, 1, self.x.dtype, self.x.device)
        for module in caches.modules:
            self._fill(module.kv_cache)
        carry = (self.x, self.x)
        return lambda: m.run_layers(carry, self.context, m.layers)


def measure_decode(bench, keys: int, pick=statistics.median, quick: bool = False) -> dict:
    """The decode section of a DEVICE entry (module docstring): seconds per piece of one step,
    pick (a statistic) of its rounds' times (quick: two rounds, for tests)."""
    hf = bench.hf
    heads, kv = hf.num_attention_heads, getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    grids = {"att_tp": share_grid(heads, heads // kv), "mlp_tp": share_grid(hf.intermediate_size, 1),
             "head": share_grid(hf.vocab_size, 1)}
    decode = DecodeBench(bench, keys)
    points = [(k, u) for k, units in grids.items() for u in units] + \
        [(k, 0) for k in ("con", "layer", "embed", "sampler")]
    with torch.no_grad():
        runs = {p: decode.runner(*p) for p in points}
        times = {p: [] for p in points}
        for run in runs.values():              # first calls allocate
            decode._refill()
            run()
        spent = dict.fromkeys(points, 0.0)
        rounds, window = (2, 0.0) if quick else (MIN_ROUNDS, WINDOW_S)
        for r in range(400):
            due = [p for p in points if r < rounds or spent[p] < window]
            if not due:
                break
            for p in due:
                decode._refill()
                t0 = time.perf_counter()
                runs[p]()
                t = time.perf_counter() - t0
                times[p].append(t)
                spent[p] += t
    out = {"keys": keys}
    for kind, units in grids.items():
        out[kind] = {"units": units, "s": [pick(times[kind, u]) for u in units]}
    for kind in ("con", "layer", "embed", "sampler"):
        out[f"{kind}_s"] = pick(times[kind, 0])
    return out
