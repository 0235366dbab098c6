"""What a plan's communication costs on the profiled link (a LINK of galaxy.planner.profiles).

A collective of `kind` over a group of n ranks moving `wire` bytes per rank (the ring convention of
galaxy.distributed.comm_bytes.ring_bytes) takes latency_s x steps + wire / bytes_per_s, with steps the
ring's rounds: n - 1 for all-gather and reduce-scatter, 2 (n - 1) for all-reduce, 1 for a send.
Where `measured` holds calls of that kind and group size, a call's time is read off them instead
(measured_time); a hand-edited fit applies everywhere once `measured` is removed.
A hand-written link may give one {"latency_s", "bytes_per_s"} for every kind.

Unequal links (a laptop on gigabit Ethernet, a board on 100 Mbit/s Wi-Fi, all through one switch):
the world's collectives run at the slowest device's link, which `fit` and `measured` hold. With
`pairs`, a send between two ranks takes their pair's own time, and a collective over a subgroup
(a Galaxy group, a data-parallel group) runs its bytes faster by min pair rate within the group /
min pair rate over the world: through a switch a ring is as slow as its slowest member's link, and
the pair rates show which member that is. The per-call latency is the world's.
"""
from __future__ import annotations

import bisect
import math

from galaxy.distributed.comm_bytes import ring_bytes
from galaxy.planner.model_terms import FP32
from galaxy.planner.profiles import ProfileError, ring_steps

DDP_BUCKET_BYTES = 25 * 2 ** 20          # torch DDP's default bucket_cap_mb


def link_time(link: dict | None, kind: str, n: int, wire_bytes: float, calls: float = 1,
              uneven: bool = False, ranks: tuple[int, ...] | None = None) -> float:
    """Seconds for `calls` collectives of `kind` over n ranks moving wire_bytes per rank in all
    (uneven: the shares differ, so all-gathers and reduce-scatters move padded shards). ranks: the
    group's global ranks (a send: (from, to)), for links profiled per pair; None: the world's rate."""
    if n <= 1 and kind != "send_recv" or (calls == 0 and wire_bytes == 0):
        return 0.0
    if link is None:
        raise ProfileError("the plan communicates but the devices profile has no link; profile the "
                           "devices together, or compose them with --link")
    if ranks is not None and link.get("pairs"):
        if kind == "send_recv":
            pair = pair_of(link, ranks[0], ranks[1])
            if pair is not None:
                return _pair_time(pair, wire_bytes, calls)
        scale = group_scale(link, ranks)
        if scale > 1.0:          # a subgroup past the world's slowest link: the fit, faster
            fit = link["fit"][kind]
            return calls * fit["latency_s"] * ring_steps(kind, n) + wire_bytes / (fit["bytes_per_s"] * scale)
    fit = link["fit"][kind]
    if calls > 0:
        per_call = measured_time(link, kind, n, wire_bytes / calls, uneven)
        if per_call is not None:
            return calls * per_call
    return calls * fit["latency_s"] * ring_steps(kind, n) + wire_bytes / fit["bytes_per_s"]


def wire_time(link: dict | None, kind: str, n: int, wire_bytes: float, ranks: tuple[int, ...] | None = None) -> float:
    """The part of link_time that is the link carrying the bytes (the fit's rate, a subgroup's
    faster where its pairs are): what overlap can hide. The rest, per call, is the ranks' own work
    (a one-core device's copies and syscalls), which it cannot (galaxy.planner.overlap_time)."""
    if n <= 1 or link is None or wire_bytes <= 0:
        return 0.0
    scale = group_scale(link, ranks) if ranks is not None else 1.0
    return wire_bytes / (link["fit"][kind]["bytes_per_s"] * max(scale, 1.0))


def pair_of(link: dict, a: int, b: int) -> dict | None:
    """The PAIR entry of ranks a and b (either order), or None."""
    for pair in link.get("pairs") or ():
        if set(pair["ranks"]) == {a, b}:
            return pair
    return None


def _pair_time(pair: dict, wire: float, calls: float) -> float:
    """`calls` sends between one pair moving `wire` bytes in all: its measured points where they
    span the size (as measured_time), else its fit."""
    if calls <= 0:
        return wire / pair["bytes_per_s"]
    points = sorted((int(m["bytes"]), float(m["seconds"])) for m in pair.get("measured") or ())
    one = wire / calls
    if len(points) < 2:
        return calls * pair["latency_s"] + wire / pair["bytes_per_s"]
    sizes, seconds = [p[0] for p in points], [p[1] for p in points]
    return calls * _interpolate(sizes, seconds, one, pair["bytes_per_s"])


def group_scale(link: dict, ranks) -> float:
    """How much faster than the world's a collective over `ranks` moves its bytes: the slowest
    pair rate within the group over the slowest in the world (1.0 without pairs, or for the world)."""
    pairs = link.get("pairs") or ()
    if len(pairs) == 0 or len(set(ranks)) < 2:
        return 1.0
    inside = [p["bytes_per_s"] for p in pairs if set(p["ranks"]) <= set(ranks)]
    if not inside:
        return 1.0
    return max(1.0, min(inside) / min(p["bytes_per_s"] for p in pairs))


def _interpolate(sizes: list[int], seconds: list[float], wire: float, bytes_per_s: float) -> float:
    """Linear between the two measured sizes around `wire`; past the largest, that point plus the
    bandwidth; below the smallest, the smallest."""
    if wire <= sizes[0]:
        return seconds[0]
    if wire >= sizes[-1]:
        return seconds[-1] + (wire - sizes[-1]) / bytes_per_s
    i = bisect.bisect_right(sizes, wire) - 1
    f = (wire - sizes[i]) / (sizes[i + 1] - sizes[i])
    return seconds[i] + f * (seconds[i + 1] - seconds[i])


def measured_time(link: dict, kind: str, n: int, wire: float, uneven: bool = False) -> float | None:
    """One call's seconds read off the link's measured points of this kind and group size (the
    uneven ones for uneven shares, where measured), linear between the two sizes around `wire`;
    past the largest, that point plus the fit's bandwidth; below the smallest, the smallest.
    None without two measured sizes: the fit alone. The points hold what a call costs at each size,
    which the two-parameter fit bends (this project's gloo link: 1.26 ms measured at 1 MiB, 0.59 ms
    fitted), and a step's collectives sit between 100 KiB and a few MiB."""
    points = _measured_points(link, kind, n, uneven)
    if points is None:
        return None
    sizes, seconds = points
    return _interpolate(sizes, seconds, wire, link["fit"][kind]["bytes_per_s"])


def _measured_points(link: dict, kind: str, n: int, uneven: bool):
    """(sizes, mean seconds at each) of the measured calls that apply, or None."""
    rows = [m for m in link.get("measured") or () if m.get("kind") == kind and m.get("group") == n]
    want = uneven and any(m.get("uneven") for m in rows)
    by_size: dict[int, list[float]] = {}
    for m in rows:
        if bool(m.get("uneven")) == want:
            by_size.setdefault(int(m["bytes"]), []).append(float(m["seconds"]))
    sizes = sorted(by_size)
    return (sizes, [sum(by_size[b]) / len(by_size[b]) for b in sizes]) if len(sizes) >= 2 else None


def data_parallel_traffic(link: dict | None, plan, held: float, trained: float, layers: int,
                          backward_through_backbone: bool, ranks=None) -> tuple[float, float]:
    """Seconds and bytes of one rank's data-parallel traffic per step (held parameters, trained of
    them, on a stage of `layers` layers; ranks: its data-parallel group): DDP all-reduces the
    trained gradients in buckets; FSDP gathers every weight it shards (again in backward under
    "full", where backward runs through it, once per micro-batch) and reduce-scatters the trained
    gradients, a call per layer."""
    dp = plan.dp
    if dp <= 1:
        return 0.0, 0.0
    if plan.dp_sharding == "none":
        if not trained:
            return 0.0, 0.0
        b = ring_bytes("all_reduce", int(trained), FP32, dp)
        calls = max(1, math.ceil(trained * FP32 / DDP_BUCKET_BYTES))
        return link_time(link, "all_reduce", dp, b, calls, ranks=ranks), b
    passes = 2 if backward_through_backbone else 1
    gathers = passes * plan.microbatches if plan.dp_sharding == "full" else 1
    ag = ring_bytes("all_gather", math.ceil(held / dp), FP32, dp)
    rs = ring_bytes("reduce_scatter", math.ceil(trained / dp), FP32, dp)
    seconds = link_time(link, "all_gather", dp, gathers * ag, gathers * layers, ranks=ranks) + \
        link_time(link, "reduce_scatter", dp, rs, layers, ranks=ranks)
    return seconds, gathers * ag + rs
