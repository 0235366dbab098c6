"""Which device holds which mesh position: the cost model of a placed plan, and the orders a search tries.

A plan's rank_order (config key mesh_rank_order) puts the process launched as rank order[i] at mesh
position i. The cost model times positions: for a placed plan it builds (once per order) a model
whose device i is the launch rank's order[i] and whose link pairs are renamed to positions, times
the plan there, and hands every per-rank figure back in launch-rank order, the order of the
devices profile and of the memory budgets. So estimates, budgets and charts always speak of the
devices as they were launched.

The order matters for pipelines of unequal devices: stage 0 waits for no other stage's fill or
drain, the last stage waits for both, so a slow device nearly as loaded as the slowest stage runs
best early and quick ones last (edge4: the laptop, then the phone with 1 layer, then the boards).
A search tries every order of up to 4 devices (24); beyond that launch order reversed and the
devices by GEMM speed, slowest first and fastest first. Orders that give every position the same
profile (identical devices and links) are tried once.
"""
from __future__ import annotations

import itertools
import json
from dataclasses import replace

EXHAUSTIVE_WORLD = 4        # every order up to this many devices (4! = 24 searches of the pipelines)


def is_identity(order) -> bool:
    return order is None or tuple(order) == tuple(range(len(order)))


def placed_link(link: dict | None, order: tuple[int, ...]) -> dict | None:
    """The link profile with its pairs named by position (device order[i] is position i)."""
    if not link or not link.get("pairs"):
        return link
    pos = {rank: i for i, rank in enumerate(order)}
    return {**link, "pairs": [{**pair, "ranks": [pos[r] for r in pair["ranks"]]} for pair in link["pairs"]]}


def placed_model(cost, order: tuple[int, ...]):
    """A cost model of the same class over the devices in `order` (cached on `cost`)."""
    cache = cost.__dict__.setdefault("_placed_models", {})
    model = cache.get(order)
    if model is None:
        model = cache[order] = type(cost)(cost.model, [cost.devices[i] for i in order], placed_link(cost.link, order),
                                          batch_size=cost.batch, optimizer=cost.optimizer, method=cost.method)
    return model


def in_launch_order(values: list, order: tuple[int, ...]) -> list:
    """Per-position values as per-launch-rank values."""
    out = [None] * len(values)
    for position, rank in enumerate(order):
        out[rank] = values[position]
    return out


def launched(est, order: tuple[int, ...]):
    """An estimate of the plan at positions as one of the placed plan, every per-rank list in
    launch-rank order."""
    lists = {name: in_launch_order(getattr(est, name), order)
             for name in ("memory_mib", "sent_bytes", "compute_s", "comm_rank_s", "sub_block_s") if getattr(est, name)}
    return replace(est, plan=replace(est.plan, rank_order=tuple(order)), **lists)


def _signature(cost, order: tuple[int, ...]) -> str:
    """What a placed model sees: its devices' profiles (names aside) and its link pairs' figures."""
    devices = [{k: v for k, v in cost.devices[i].items() if k not in ("name", "host")} for i in order]
    link = placed_link(cost.link, order) or {}
    pairs = sorted((tuple(sorted(p["ranks"])), p.get("latency_s"), p.get("bytes_per_s")) for p in link.get("pairs", []))
    return json.dumps([devices, pairs], sort_keys=True, default=str)


def device_orders(cost) -> list[tuple[int, ...]]:
    """The launch-rank orders a search places pipelines by, identity first (module docstring)."""
    world = cost.world
    if world <= EXHAUSTIVE_WORLD:
        orders = list(itertools.permutations(range(world)))
    else:
        ident = tuple(range(world))
        by_speed = tuple(sorted(ident, key=lambda r: cost.devices[r].get("gemm_flops_per_s", 0.0)))
        orders = [ident, ident[::-1], by_speed, by_speed[::-1]]
    seen, out = set(), []
    for order in orders:
        key = _signature(cost, order)
        if key not in seen:
            seen.add(key)
            out.append(tuple(order))
    return out
