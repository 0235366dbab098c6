"""When each pipeline stage finishes its micro-batches, from the schedule's own order of work.

A stage runs its forwards (F) and backwards (B) one at a time in the order its schedule gives
(torch's order, which galaxy.pipeline.overlap_schedule keeps):

  gpipe  F0 .. F(m-1), then B0 .. B(m-1)
  1f1b   w_p = min(m, pp - p) forwards (stage p; the first stage pp, the last one), or the plan's
         pipeline_warmup_list entry, then one backward and one forward in turn while forwards
         remain, then the remaining backwards

and an op starts when the stage is free and its input has arrived: F_i on stage p > 0 after F_i
on stage p - 1 plus one hop (the activation's send), B_i on stage p < pp - 1 after B_i on stage
p + 1 plus one hop (the gradient's). A send occupies its link, not its stage: Galaxy's engine
posts every receive when the step starts and waits for its sends only when the step ends, so a
stage computes on while its sends travel. A boundary's link carries one micro-batch at a time in
each direction, in order: a hop starts when its tensor is ready and the link has delivered the
one before it (on a slow link with quick stages the link, not the stages, sets the pace).

The closed form sum_p t_p + (m - 1) max_p t_p is this for equal stages, and a bound for unequal
ones: with a slow first stage and a quick last one, the last stage's work of micro-batch i hides
under the first stage's forward of micro-batch i + 1, and the step is the first stage's m (F + B)
alone.
"""
from __future__ import annotations

import functools

from galaxy.planner.link_model import link_time


def stage_order(schedule: str, p: int, pp: int, m: int, warmup: int | None = None) -> list[tuple[str, int]]:
    """Stage p's ops in the order it runs them: ("F" | "B", micro-batch); warmup: 1f1b's forwards
    before the first backward (None: pp - p)."""
    if schedule == "gpipe" or pp == 1:
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warmup = min(m, pp - p if warmup is None else warmup)
    order = [("F", i) for i in range(warmup)]
    for i in range(m):
        order.append(("B", i))
        if warmup + i < m:
            order.append(("F", warmup + i))
    return order


def hop_time(link: dict | None, nbytes: float, pairs) -> float:
    """One micro-batch's send of nbytes across a boundary, every (sender, receiver) rank pair of
    `pairs` at once: the slowest pair's wire time. Galaxy's engine posted the receive when the step
    began, so the bytes go as soon as the tensor is ready; a profiled send's per-call latency (the
    receiver's handshake, the ranks' copies) is paid behind compute by gloo's threads. Measured on
    edge4 (196 KB a micro-batch): hops of 4-5 ms at 300 Mbit/s and 15-20 ms at 100 Mbit/s, the
    profile's wire times 4.9 and 15.5 ms, against 9.1 and 21.6 ms with its latency."""
    return max(link_time(link, "send_recv", 2, nbytes, 0, ranks=pair) for pair in pairs)


@functools.lru_cache(maxsize=65536)       # the search asks for the same stage times many times
def stage_ends(fwd: tuple[float, ...], bwd: tuple[float, ...], hop: float | tuple[float, ...], m: int,
               schedule: str, warmup: tuple[int, ...] | None = None) -> tuple[float, ...]:
    """Seconds from the step's start until each stage has run its last op (fwd / bwd: one micro-
    batch's forward / backward on each stage; hop: one send between neighbouring stages, or one
    per boundary, p to p + 1, where the links differ; warmup: 1f1b's per stage, None: pp - p)."""
    pp = len(fwd)
    hops = tuple(hop) if isinstance(hop, tuple) else (hop,) * max(pp - 1, 0)
    orders = [stage_order(schedule, p, pp, m, None if warmup is None else warmup[p]) for p in range(pp)]
    done: dict[tuple[str, int, int], float] = {}       # (op, micro-batch, stage) -> end time
    free = [0.0] * pp
    delivered: dict[tuple[str, int], float] = {}        # (op, boundary) -> its link's last arrival
    nxt = [0] * pp
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for p in range(pp):
            while nxt[p] < len(orders[p]):
                op, i = orders[p][nxt[p]]
                if op == "F":
                    dep = ("F", i, p - 1) if p > 0 else None
                else:
                    dep = ("B", i, p + 1) if p < pp - 1 else None
                if dep is not None and dep not in done:
                    break
                ready = 0.0
                if dep is not None:         # the hop waits for its tensor and for the link
                    link = (op, min(p, dep[2]))
                    ready = delivered[link] = max(done[dep], delivered.get(link, 0.0)) + hops[link[1]]
                start = max(free[p], ready)
                free[p] = done[op, i, p] = start + (fwd[p] if op == "F" else bwd[p])
                nxt[p] += 1
                remaining -= 1
                progressed = True
        if not progressed:        # every schedule above is free of cycles; this would be a bug
            raise RuntimeError(f"pipeline schedule {schedule!r} deadlocked at {nxt} of {pp} stages")
    return tuple(free)
