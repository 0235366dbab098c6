"""The local search's moves: the few plans one step from an estimate that can beat it.

The plan search (galaxy.planner.search.Searcher.optimize) starts from shares, stages and rows
proportional to speed, then every round estimates the plans these functions build around its
current estimate and keeps the best. Each move takes a step from where the estimate shows the most
time (or the least memory room) to where it shows the least time (or the most room), so a round
costs a handful of estimates, not one per neighbouring plan:

  shares   `step` units of one share list (heads, columns, tokens, decode columns) from the Galaxy
           rank slowest at the sub-blocks that use it to the two quickest, and the second slowest
           to the quickest; when a rank is over its budget, also from the one with the least room
           to the two with the most. A Galaxy rank's time and room are its worst over every group,
           since every group uses the same lists. The steps go from about a quarter of a rank's
           share down to one unit (step_sizes).
  stages   one layer from the slowest (or fullest) stage to any other, and from every stage to its
           neighbours
  rows     one row per micro-batch from the slowest (or fullest) data-parallel replica to the two
           that would be quickest holding it (or the two roomiest)

1f1b's warm-ups move in galaxy.planner.warmup.
"""
from __future__ import annotations

from dataclasses import replace

from galaxy.plan import Plan
from galaxy.planner.cost import CostModel, Estimate


def uneven(rows: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """Replica rows as a plan holds them: None when every replica has the same."""
    return None if rows is None or len(set(rows)) == 1 else tuple(rows)


def step_sizes(total: int, unit: int, g: int) -> list[int]:
    """The steps a share list of `total` over g Galaxy ranks moves by, largest first: unit, doubled
    while a step stays within about a quarter of an even share (step * g * 4 <= total)."""
    step, out = unit, []
    while step * g * 4 <= total:
        out.append(step)
        step *= 2
    return sorted(set(out + [unit]), reverse=True)


def galaxy_rank_load(est: Estimate, budgets: list[float], subs) -> tuple[list[float], list[float]]:
    """Per Galaxy rank: its worst time at the sub-blocks `subs` over every group, and its worst
    memory room (budget - need) over every group."""
    g = est.plan.group
    t, room = [0.0] * g, [float("inf")] * g
    for r in range(len(est.memory_mib)):            # every global rank; r % g is its Galaxy rank
        j = r % g
        t[j] = max(t[j], sum(est.sub_block_s[r].get(s, 0.0) for s in subs))
        room[j] = min(room[j], budgets[r] - est.memory_mib[r])
    return t, room


def share_moves(est: Estimate, budgets: list[float], name: str, step: int, unit: int, subs) -> list[Plan]:
    """Plans with `step` units of the share list `name` moved: from the rank with the least memory
    room to those with the most (when over budget), from the slowest at `subs` to the quickest."""
    plan = est.plan
    shares = list(getattr(plan, name))
    g = len(shares)
    t, room = galaxy_rank_load(est, budgets, subs)
    order_t = sorted(range(g), key=lambda j: t[j])
    order_room = sorted(range(g), key=lambda j: room[j])
    pairs = []
    if any(r < 0 for r in room):
        pairs += [(order_room[0], b) for b in order_room[::-1][:2]]
    pairs += [(order_t[-1], b) for b in order_t[:2]]
    if g > 2:
        pairs.append((order_t[-2], order_t[0]))
    out = []
    for a, b in dict.fromkeys(pairs):
        if a == b or shares[a] - step < unit:
            continue
        trial = list(shares)
        trial[a] -= step
        trial[b] += step
        out.append(replace(plan, **{name: tuple(trial)}))
    return out


def stage_moves(est: Estimate, budgets: list[float], cost: CostModel) -> list[Plan]:
    """Plans with one layer moved from the slowest (or fullest) stage to any other, and from
    every stage to its neighbours. Not only off the slowest: under the schedule a quick stage's
    work can hide under a slow one's, so loading the busiest stage further can shorten the
    step (a slow device holding the last stage with a single layer)."""
    plan = est.plan
    stages, pp = plan.stages, plan.pp
    stage_t = [max(est.compute_s[r] for r in cost.stage_ranks(plan, p)) for p in range(pp)]
    room = [min(budgets[r] - est.memory_mib[r] for r in cost.stage_ranks(plan, p)) for p in range(pp)]
    slow = max(range(pp), key=lambda p: stage_t[p])
    pairs = [(slow, b) for b in range(pp)]
    if min(room) < 0:
        full = min(range(pp), key=lambda p: room[p])
        pairs += [(full, b) for b in range(pp)]
    pairs += [(a, a + d) for a in range(pp) for d in (-1, 1) if 0 <= a + d < pp]
    out = []
    for a, b in dict.fromkeys(pairs):
        if a == b or stages[a] <= 1:
            continue
        trial = list(stages)
        trial[a] -= 1
        trial[b] += 1
        out.append(replace(plan, stages=tuple(trial)))
    return out


def row_moves(est: Estimate, budgets: list[float], cost: CostModel) -> list[Plan]:
    """Plans with one row per micro-batch moved between replicas: from the slowest (its ranks'
    compute and communication) to the two that would be quickest with it (their time scaled by
    rows + m over rows: a replica quick only because it holds few rows is not the best place for
    one more), and from the one with the least memory room to the two with the most when a rank
    is over its budget."""
    plan, m = est.plan, est.plan.microbatches
    rows = cost.replica_rows(plan)
    replica_ranks = [[r for p in range(plan.pp) for r in range((p * plan.dp + d) * plan.group,
                                                               (p * plan.dp + d + 1) * plan.group)]
                     for d in range(plan.dp)]
    t = [max(est.compute_s[r] + est.comm_rank_s[r] for r in ranks) for ranks in replica_ranks]
    room = [min(budgets[r] - est.memory_mib[r] for r in ranks) for ranks in replica_ranks]
    slowest = max(range(plan.dp), key=lambda d: t[d])
    with_one_more = sorted((d for d in range(plan.dp) if d != slowest), key=lambda d: t[d] * (rows[d] + m) / rows[d])
    pairs = [(slowest, b) for b in with_one_more[:2]]
    if min(room) < 0:
        by_room = sorted(range(plan.dp), key=lambda d: room[d])
        pairs += [(by_room[0], b) for b in by_room[::-1][:2]]
    out = []
    for a, b in dict.fromkeys(pairs):
        if a == b or rows[a] - m < m:
            continue
        trial = [int(x) for x in rows]
        trial[a] -= m
        trial[b] += m
        out.append(replace(plan, replica_rows=uneven(tuple(trial))))
    return out
