"""1f1b's warm-up forwards per stage (pipeline_warmup_list) as moves of the plan search.

Under torch's 1F1B stage p runs pp - p forwards before its first backward. That covers the round
trip of micro-batch 0 through the later stages only when every stage takes as long as stage p; a
quicker stage waiting on slower ones downstream idles at its first backward, and again at the end
while the last micro-batch goes down and back. More warm-up forwards fill that wait, each holding
one more micro-batch's activations (the memory model's in_flight). On edge4 with the phone first
(galaxy.planner.placement), [1, 3, 1, 1] x 12: predicted 1247 ms under torch's warm-ups, 1051 ms
under [8, 5, 3, 1].

The moves, from an estimate's per-stage passes (forward F_q, backward B_q, send h_q to q + 1):
  cover    each stage's warm-up raised to what covers its downstream round trip
           RT_p = sum_{q > p} (F_q + B_q) + 2 sum_{q >= p} h_q: 1 + RT_p / (F_p + B_p) (the
           steady state's) and 1 + RT_p / F_p (the first backward's: only forwards run before it)
  torch's  pp - p again
  one      one stage's warm-up one up or down, once no other move helps (they are many)
each made non-increasing along the pipeline (a stage may not wait for more forwards than its
upstream neighbour sends ahead) and capped at m. Only Galaxy's own engine (gloo) runs other
warm-ups than torch's, so only a training search over a gloo link moves them.
"""
from __future__ import annotations

import math
from dataclasses import replace


def warmups_searched(cost) -> bool:
    """Whether a search over `cost` moves warm-ups: a training cost model (one that times overlap)
    whose link runs gloo."""
    link = cost.link or {}
    return bool(getattr(cost, "times_overlap", False)) and link.get("backend", "gloo") == "gloo"


def defaults(pp: int, m: int) -> tuple[int, ...]:
    return tuple(min(m, pp - p) for p in range(pp))


def normal(warmup, pp: int, m: int) -> tuple[int, ...] | None:
    """warmup made non-increasing (raising earlier stages) and capped at m; None when it is
    torch's own."""
    w = [min(m, max(1, x)) for x in warmup]
    for p in range(pp - 2, -1, -1):
        w[p] = max(w[p], w[p + 1])
    w = tuple(w)
    return None if w == defaults(pp, m) else w


def cover(passes, steady: bool) -> list[int]:
    """Each stage's warm-up covering its downstream round trip (module docstring; normal caps it at m)."""
    pp = len(passes)
    out = []
    for p, (f, b, _) in enumerate(passes):
        trip = sum(fq + bq for fq, bq, _ in passes[p + 1:]) + 2 * sum(h for _, _, h in passes[p:pp - 1])
        per = f + b if steady else f
        out.append(max(pp - p, 1 + math.ceil(trip / max(per, 1e-9))) if p < pp - 1 else 1)
    return out


def warmup_moves(est, fine: bool) -> list:
    """Plans with moved warm-ups around est.plan (a 1f1b pipeline): torch's and the two covers,
    and with `fine` every one-stage step (the search takes those last: pp x 2 more estimates a
    round)."""
    plan, passes = est.plan, est.stage_passes
    pp, m = plan.pp, plan.microbatches
    current = list(plan.warmup or defaults(pp, m))
    trials = [defaults(pp, m)] + ([cover(passes, True), cover(passes, False)] if passes else [])
    for p in range(pp if fine else 0):
        for d in (1, -1):
            w = list(current)
            w[p] += d
            trials.append(w)
    out = []
    for w in trials:
        moved = normal(w, pp, m)
        if moved != plan.warmup:
            out.append(replace(plan, warmup=moved))
    return out
