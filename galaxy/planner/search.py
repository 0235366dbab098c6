"""The plan search: the fastest plan whose every rank fits its memory budget.

Enumerated: the mesh (pp x dp x Galaxy group size dividing the world), the methods (ATT TP|SP,
MLP TP|SP, CON SP|None; one choice for a group of 1), the micro-batches (divisors of the rows per
replica: pipeline micro-batches, or grad_accum_steps without a pipeline), the pipeline schedule (both
1f1b and gpipe where there are at least pp micro-batches, else gpipe: schedules) and sharded data
parallelism (with replicas). For each, the integer choices are optimised by local search:

  start    heads / columns / tokens (and, for the latency objective, an SP MLP's decode columns)
           per Galaxy rank proportional to its speed (the slowest device
           holding that Galaxy rank in any group: every group uses the same lists), in whole
           units (a K/V group of heads for grouped-query attention); layers per stage
           proportional to the stage's speed; rows of the global batch per data-parallel replica
           proportional to the replica's speed (its slowest device), in whole micro-batches
           (dp_batch_list; even rows are left as null)
  moves    a step of units from the rank that is most over its budget, or slowest at the
           sub-blocks that share splits, to the one with the most room or the least time (steps
           from about a quarter of a share down to one unit); a layer from the slowest or fullest
           stage to any other, and from every stage to its neighbours; one row per micro-batch
           from the slowest (or fullest) replica to the quickest (or roomiest) two
           (galaxy.planner.moves); 1f1b's warm-ups (galaxy.planner.warmup)
  accept   a move that lowers the total memory overflow, or keeps it and lowers the step time
  memory   after every move each stage recomputes the fewest leading layers
           (activation_checkpointing) that make its ranks fit, all of them when nothing else does

so shares follow speed where memory is ample and leave it where a device's budget caps them.
Last, each of the 2 x top best plans takes the batch_streams and comm_chunks that the cost model
finds fastest (galaxy.planner.overlap_time).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, replace

from galaxy.plan import METHODS as PLAN_METHODS
from galaxy.plan import Plan
from galaxy.planner.cost import CostModel, Estimate
from galaxy.planner.moves import row_moves, share_moves, stage_moves, step_sizes, uneven
from galaxy.planner.overlap_time import overlap_choices
from galaxy.planner.placement import device_orders, launched, placed_model
from galaxy.planner.warmup import warmup_moves, warmups_searched

METHODS = [(a, m, c) for a in PLAN_METHODS["att"] for m in PLAN_METHODS["mlp"] for c in PLAN_METHODS["con"]]
MAX_MICROBATCHES = 64


@dataclass
class SearchResult:
    ranked: list[Estimate]          # plans that fit, fastest first
    leanest: Estimate | None        # the plan closest to fitting, when none fits
    budgets: list[float]
    tried: int
    seconds: float


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def schedules(pp: int, m: int) -> tuple[str, ...]:
    """The schedules a search starts from for pp stages and m micro-batches: 1f1b holds fewer
    micro-batches (less memory) but with unequal stages gpipe can end sooner (home3 [3, 2, 1] x 12:
    932-949 ms against 1f1b's 996-1047). 1f1b needs m >= pp; one stage runs no schedule."""
    if pp == 1:
        return ("1f1b",)
    return ("1f1b", "gpipe") if m >= pp else ("gpipe",)


def proportional(total: int, unit: int, weights: list[float]) -> tuple[int, ...]:
    """Split total (a multiple of unit) in whole units proportional to weights, at least one unit
    each (largest remainders first)."""
    units, n = total // unit, len(weights)
    if units < n:
        raise ValueError(f"{units} units cannot give {n} ranks one each")
    s = sum(weights)
    raw = [units * w / s for w in weights]
    parts = [max(1, int(x)) for x in raw]
    while sum(parts) > units:                       # the max(1, .) floors overshot
        i = max((i for i in range(n) if parts[i] > 1), key=lambda i: parts[i] - raw[i])
        parts[i] -= 1
    for i in sorted(range(n), key=lambda i: raw[i] - parts[i], reverse=True)[: units - sum(parts)]:
        parts[i] += 1
    while sum(parts) < units:
        parts[max(range(n), key=lambda i: raw[i] - parts[i])] += 1
    return tuple(p * unit for p in parts)


class Searcher:
    uneven_rows = True      # choose rows per replica (the encoder-decoder search keeps them even)

    def __init__(self, cost: CostModel, budgets: list[float], *, dp_sharding: tuple[str, ...] = ("none",),
                 meshes: list[tuple[int, int]] | None = None, methods=None, max_moves: int = 400,
                 pipelines_only: bool = False):
        """pipelines_only: enumerate pp > 1 meshes alone (a placed model's search: elsewhere the
        order of the devices changes nothing the shares and rows do not already choose)."""
        self.cost, self.budgets = cost, list(budgets)
        self.pipelines_only = pipelines_only
        self.warmups = warmups_searched(cost)
        self.model = cost.model
        self.sharding = dp_sharding
        self.meshes = meshes
        self.methods = methods
        self.max_moves = max_moves
        self.tried = 0
        self._seen: dict[Plan, tuple] = {}
        u = self.model["units"]
        self.heads, self.head_unit = u["att_tp"]
        self.columns = u["mlp_tp"][0]
        self.seq = self.model["pad_size"]
        self.layers = cost.layers
        self.speed = [self._speed(r) for r in range(cost.world)]
        # The latency cost model times a decode step, where an SP MLP splits by its decode columns.
        self._decode_columns = getattr(cost, "decode_columns", False)

    def _speed(self, r: int) -> float:
        c, rows = self.cost.compute[r], self.cost.batch
        runs = {i for i, _ in self.cost.sub_blocks()}     # the cost model's indices: ATT CON MLP CON SIDE
        t = sum(sum(c(kind, units, rows)) for i, kind, units in
                ((0, "att_tp", self.heads), (2, "mlp_tp", self.columns), (1, "con", self.seq), (3, "con", self.seq),
                 (4, "side", self.seq)) if i in runs)
        return 1.0 / max(t, 1e-12)

    # --- scoring ----------------------------------------------------------------------------------

    def evaluate(self, plan: Plan) -> tuple[tuple, Estimate]:
        """(score, estimate): score = (total MiB over budget, step seconds), lower is better."""
        hit = self._seen.get(plan)
        if hit is None:
            fitted = self.fit_checkpointing(plan)
            est = self.cost.estimate(fitted)
            self.tried += 1
            hit = self._seen[plan] = ((round(sum(est.shortfall(self.budgets)), 3), est.step_s), est)
        return hit

    def fit_checkpointing(self, plan: Plan) -> Plan:
        """The fewest leading layers per stage whose recomputation makes the stage's ranks fit."""
        ckpt = [0] * plan.pp
        plan = replace(plan, checkpoint=())
        if not self.cost.backward_through_backbone:       # nothing to recompute (side-tuning)
            return plan.with_stage_checkpoints(ckpt)
        mem = self.cost.estimate_memory(plan)
        for p in range(plan.pp):
            ranks = self.cost.stage_ranks(plan, p)
            if all(mem[r] <= self.budgets[r] for r in ranks):
                continue
            lo, hi = 1, plan.stages[p]
            best = hi
            while lo <= hi:                       # memory falls as layers are checkpointed
                mid = (lo + hi) // 2
                trial = list(ckpt)
                trial[p] = mid
                m2 = self.cost.estimate_memory(plan.with_stage_checkpoints(trial))
                if all(m2[r] <= self.budgets[r] for r in ranks):
                    best, hi = mid, mid - 1
                else:
                    lo = mid + 1
            ckpt[p] = best
        return plan.with_stage_checkpoints(ckpt)

    # --- the enumeration -------------------------------------------------------------------------

    def candidates(self):
        W, batch = self.cost.world, self.cost.batch
        for pp in divisors(W):
            if pp > self.layers or (self.pipelines_only and pp == 1):
                continue
            for dp in divisors(W // pp):
                if self.meshes is not None and (pp, dp) not in self.meshes:
                    continue
                if batch % dp:
                    continue
                g = W // (pp * dp)
                rows = batch // dp
                methods = [("TP", "TP", "SP")] if g == 1 else [
                    m for m in (self.methods or METHODS) if self._feasible(m, g)]
                mbs = [m for m in divisors(rows) if m <= MAX_MICROBATCHES]
                # sharded data parallelism: over dp replicas (pipeline stages included)
                shardings = [s for s in self.sharding if s == "none" or dp > 1]
                for (att, mlp, con), m, shard in itertools.product(methods, mbs, shardings):
                    for schedule in schedules(pp, m):
                        yield pp, dp, g, att, mlp, con, m, shard, schedule

    def _feasible(self, methods, g: int) -> bool:
        att, mlp, con = methods
        if att == "TP" and self.heads // self.head_unit < g:
            return False
        if mlp == "TP" and self.columns < g:
            return False
        if "SP" in methods and self.seq < g:
            return False
        return True

    def initial(self, pp, dp, g, att, mlp, con, m, shard, schedule) -> Plan:
        # Galaxy rank j's speed: its slowest device over every group (they all use the same shares).
        pos = [min(self.speed[(p * dp + d) * g + j] for p in range(pp) for d in range(dp)) for j in range(g)]
        # A split the plan does not use still needs one entry per rank (the writer leaves it out).
        heads = proportional(self.heads, self.head_unit, pos) if self.heads // self.head_unit >= g \
            else (self.heads,) * g
        columns = proportional(self.columns, 1, pos) if self.columns >= g else (self.columns,) * g
        tokens = proportional(self.seq, 1, pos) if self.seq >= g else (self.seq,) * g
        stage_speed = [min(self.speed[(p * dp + d) * g + j] for d in range(dp) for j in range(g)) * g
                       for p in range(pp)]
        stages = proportional(self.layers, 1, stage_speed) if pp > 1 else (self.layers,)
        replica_speed = [min(self.speed[(p * dp + d) * g + j] for p in range(pp) for j in range(g)) for d in range(dp)]
        rows = proportional(self.cost.batch, m, replica_speed) if dp > 1 else None
        decode = columns if mlp == "SP" and self._decode_columns and g > 1 else None
        return Plan(att=att, mlp=mlp, con=con, pp=pp, dp=dp, heads=heads, columns=columns, tokens=tokens,
                    stages=stages, microbatches=m, schedule=schedule, checkpoint=(), dp_sharding=shard,
                    replica_rows=uneven(rows), decode_columns=decode)

    # --- local search ----------------------------------------------------------------------------

    def _vectors(self, plan: Plan):
        """(field, unit, sub-blocks that use it) of the shares this plan actually uses."""
        if plan.group == 1:
            return []
        out = []
        if plan.att == "TP":
            out.append(("heads", self.head_unit, ("ATT",)))
        if plan.mlp == "TP":
            out.append(("columns", 1, ("MLP",)))
        uses = tuple(s for s, on in (("ATT", plan.att == "SP"), ("MLP", plan.mlp == "SP"),
                                     ("CON", plan.con == "SP"), ("HEAD", plan.con == "SP")) if on)
        if uses:
            out.append(("tokens", 1, uses))
        if plan.decode_columns is not None:
            out.append(("decode_columns", 1, ("MLP decode",)))
        return out

    def optimize(self, plan: Plan) -> tuple[tuple, Estimate]:
        """Local search from `plan`: every round tries, for each share list at its current step and
        for the stages, rows and warm-ups, the few moves that can help (galaxy.planner.moves,
        galaxy.planner.warmup) and takes the best by `_better`; when none helps, the steps halve; it
        ends when no move at one unit helps."""
        score, est = self.evaluate(plan)
        g = plan.group
        vectors = self._vectors(plan)
        steps = {name: step_sizes(sum(getattr(plan, name)), unit, g)[0] for name, unit, _ in vectors}
        warm = self.warmups and plan.pp > 1 and plan.schedule == "1f1b"
        fine = False            # one stage's warm-up one up or down: once nothing coarser helps
        for _ in range(self.max_moves):
            candidates = []
            for name, unit, subs in vectors:
                candidates += share_moves(est, self.budgets, name, steps[name], unit, subs)
            if plan.pp > 1:
                candidates += stage_moves(est, self.budgets, self.cost)
            if warm:
                candidates += warmup_moves(est, fine)
            if plan.dp > 1 and self.uneven_rows:
                candidates += row_moves(est, self.budgets, self.cost)
            best = None
            for trial in dict.fromkeys(candidates):
                s, e = self.evaluate(trial)
                if self._better(s, score, best[0] if best else None):
                    best = (s, e)
            if best is not None:
                score, est = best
                continue
            coarse = [name for name, unit, _ in vectors if steps[name] > unit]
            if not coarse:
                if warm and not fine:
                    fine = True
                    continue
                break
            for name, unit, _ in vectors:
                steps[name] = max(unit, steps[name] // 2 // unit * unit)
        return score, est

    @staticmethod
    def _better(new: tuple, current: tuple, best: tuple | None) -> bool:
        """Over budget: the move must cut the overflow, and the most MiB freed per second added wins.
        Within budget: it must stay within and be faster; the fastest wins."""
        over, t = current

        def gain(s):                    # what a move buys, bigger is better
            if over > 0:
                freed = over - s[0]
                return float("inf") if s[1] <= t else freed / (s[1] - t)
            return -s[1]
        if over > 0 and not new[0] < over:
            return False
        if over == 0 and not (new[0] == 0 and new[1] < t):
            return False
        return best is None or gain(new) > gain(best)

    def with_overlap(self, score: tuple, est: Estimate) -> tuple[tuple, Estimate]:
        """The optimised plan under the batch_streams x comm_chunks the cost model finds fastest
        (galaxy.planner.overlap_time.overlap_choices), the plan as it is on a tie. Only under a cost
        model that times them (the training one; the encoder-decoder and latency models leave 1)."""
        if not getattr(self.cost, "times_overlap", False):
            return score, est
        rows = min(self.cost.replica_rows(est.plan)) // est.plan.microbatches
        for trial in overlap_choices(est.plan, int(rows)):
            s, e = self.evaluate(trial)
            if s < score:
                score, est = s, e
        return score, est

    def ranked(self, top: int) -> list[tuple[tuple, Estimate]]:
        """(score, estimate) of every plan the local searches ended at, best first."""
        results: dict[Plan, tuple] = {}
        for cand in self.candidates():
            score, est = self.optimize(self.initial(*cand))
            results.setdefault(est.plan, (score, est))
        ordered = sorted(results.values(), key=lambda se: se[0])
        # the overlap settings for the leading plans only (12 estimates a plan): they speed a plan
        # up by a part of its communication, not enough to lift one from far down the ranking
        return sorted([self.with_overlap(*se) for se in ordered[:2 * top]] + ordered[2 * top:], key=lambda se: se[0])

    def run(self, top: int = 5, more=(), ranked=None) -> SearchResult:
        """The search; more: (score, estimate) pairs found elsewhere (placed searches) to rank with;
        ranked: this searcher's own, when already run."""
        start = time.perf_counter()
        ordered = sorted([*(self.ranked(top) if ranked is None else ranked), *more], key=lambda se: se[0])
        fitting = [e for s, e in ordered if s[0] == 0]
        leanest = None if fitting else (ordered[0][1] if ordered else None)
        if not fitting and ordered:      # closest: the least total overflow, then the least worst rank
            leanest = min((e for _, e in ordered),
                          key=lambda e: (sum(e.shortfall(self.budgets)), max(e.shortfall(self.budgets))))
        return SearchResult(fitting[:top], leanest, self.budgets, self.tried, time.perf_counter() - start)


def search(cost: CostModel, budgets: list[float], *, top: int = 5, dp_sharding=("none",), **kw) -> SearchResult:
    """Every plan in launch order, then the pipelines under each other order of the devices
    (galaxy.planner.placement), ranked together. A placed search tries only the two pipelined
    meshes (pp x dp) and, for stages split by a Galaxy group, the two method combinations that did
    best in launch order: which mesh and methods suit the devices and links hardly depends on the
    order of the stages, and the rest would be most of the search's time (2 x 1 x 2 on 4 devices:
    8 method combinations; 8 devices: 9 orders of 7 pipelined meshes)."""
    start = time.perf_counter()
    first = Searcher(cost, budgets, dp_sharding=dp_sharding, **kw)
    ranked = first.ranked(top)
    piped = [e.plan for _, e in ranked if e.plan.pp > 1]
    meshes = list(dict.fromkeys((p.pp, p.dp) for p in piped))[:2]
    methods = list(dict.fromkeys((p.att, p.mlp, p.con) for p in piped if p.group > 1))[:2]
    placed, tried = [], 0
    for order in device_orders(cost)[1:] if meshes else ():
        s = Searcher(placed_model(cost, order), [budgets[i] for i in order], dp_sharding=dp_sharding,
                     pipelines_only=True, **{**kw, "meshes": meshes, "methods": kw.get("methods") or methods or None})
        placed += [(score, launched(est, order)) for score, est in s.ranked(top)]
        tried += s.tried
    result = first.run(top, placed, ranked)
    return replace(result, tried=result.tried + tried, seconds=time.perf_counter() - start)
