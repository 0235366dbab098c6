"""The plan search for an encoder-decoder (BART, T5): galaxy.planner.search's local search over
galaxy.planner.encdec_cost, with the encoder-decoder's two more choices.

Enumerated: pp x dp dividing the world (dp the batch; the Galaxy group the rest), the methods
ATT TP|SP, MLP TP|SP, CON SP|None and XATT TP|SP (16; one choice for a group of 1), the
micro-batches (pipeline micro-batches, or gradient accumulation without a pipeline), the schedule
(galaxy.planner.search.schedules: 1f1b and gpipe from pp micro-batches on, else gpipe) and, with replicas, the dp_sharding choices given. A
pipeline's stages split the layer list, the encoder's layers then the decoder's (a stage may hold
both), proportional to the stages' speed to start with, then moved a layer at a time as
galaxy.planner.search moves them. The fine-tuning method is the cost model's (a PEFT method: what
trains, saves and runs, galaxy.planner.encdec_cost); side-tuning recomputes nothing. The shares
start proportional to speed: heads (ATT and XATT under TP), MLP columns, source tokens and target
tokens (decoder_seq_scatter_list), each then moved unit by unit as the search moves the others;
each plan recomputes the fewest leading layers of each stage (the encoder's first) that make it fit.
"""
from __future__ import annotations

import itertools

from galaxy.plan import METHODS as PLAN_METHODS
from galaxy.plan import Plan
from galaxy.planner.encdec_cost import EncDecCostModel
from galaxy.planner.search import MAX_MICROBATCHES, SearchResult, Searcher, divisors, proportional, schedules

METHODS = list(itertools.product(PLAN_METHODS["att"], PLAN_METHODS["mlp"], PLAN_METHODS["con"],
                                 PLAN_METHODS["xatt"]))


class EncDecSearcher(Searcher):
    uneven_rows = False     # EncDecCostModel times even rows per replica

    def __init__(self, cost: EncDecCostModel, budgets: list[float], *, dp_sharding: tuple[str, ...] = ("none",),
                 meshes=None, max_moves: int = 400):
        self.cost, self.budgets = cost, list(budgets)
        self.model = cost.model
        self.sharding = dp_sharding
        self.meshes, self.methods, self.max_moves = meshes, None, max_moves
        self.pipelines_only, self.warmups = False, False     # launch order, torch's warm-ups
        self.tried = 0
        self._seen: dict[Plan, tuple] = {}
        units = cost.stacks["encoder"]["units"]
        self.heads, self.head_unit = units["att_tp"][0], 1
        self.columns = units["mlp_tp"][0]
        self.seq, self.target = cost.source, cost.target
        self.layers = cost.layers
        self.speed = [self._speed(r) for r in range(cost.world)]

    def _speed(self, r: int) -> float:
        """1 / the device's seconds for one of each stack's layers whole, on the whole batch."""
        whole = {"att": ("att_tp", self.heads), "xatt": ("xatt_tp", self.heads), "mlp": ("mlp_tp", self.columns)}
        t = 0.0
        for stack, tokens in (("encoder", self.seq), ("decoder", self.target)):
            for sub in self.cost.subs(stack):
                kind, units = whole.get(sub, (sub if sub == "side" else "con", tokens))
                t += sum(self.cost.flops_time(r, stack, kind, units, self.cost.batch))
        return 1.0 / max(t, 1e-12)

    def candidates(self):
        W, batch = self.cost.world, self.cost.batch
        for pp, dp in itertools.product(divisors(W), divisors(W)):
            if W % (pp * dp) or pp > self.layers or batch % dp or \
                    (self.meshes is not None and (pp, dp) not in self.meshes):
                continue
            g = W // (pp * dp)
            methods = [("TP", "TP", "SP", "TP")] if g == 1 else [m for m in METHODS if self._feasible(m, g)]
            mbs = [m for m in divisors(batch // dp) if m <= MAX_MICROBATCHES]
            shardings = [s for s in self.sharding if s == "none" or dp > 1]
            for (att, mlp, con, xatt), m, shard in itertools.product(methods, mbs, shardings):
                for schedule in schedules(pp, m):
                    yield pp, dp, g, att, mlp, con, xatt, m, shard, schedule

    def _feasible(self, methods, g: int) -> bool:
        att, mlp, con, xatt = methods
        if "TP" in (att, xatt) and self.heads < g:
            return False
        if mlp == "TP" and self.columns < g:
            return False
        return "SP" not in methods or min(self.seq, self.target) >= g

    def initial(self, pp, dp, g, att, mlp, con, xatt, m, shard, schedule) -> Plan:
        # Galaxy rank j's speed: its slowest device over every group (they all use the same lists)
        pos = [min(self.speed[(p * dp + d) * g + j] for p in range(pp) for d in range(dp)) for j in range(g)]

        def split(total):
            return proportional(total, 1, pos) if total >= g else (total,) * g
        stage_speed = [sum(min(self.speed[(p * dp + d) * g + j] for d in range(dp)) for j in range(g))
                       for p in range(pp)]
        stages = proportional(self.layers, 1, stage_speed) if pp > 1 else (self.layers,)
        return Plan(att=att, mlp=mlp, con=con, xatt=xatt, pp=pp, dp=dp, heads=split(self.heads),
                    columns=split(self.columns), tokens=split(self.seq), decoder_tokens=split(self.target),
                    stages=stages, microbatches=m, schedule=schedule, checkpoint=(),
                    dp_sharding=shard)

    def _vectors(self, plan: Plan):
        """(field, unit, sub-blocks that use it) of the shares this plan uses."""
        if plan.group == 1:
            return []
        out = []
        tp = tuple(s for s, on in (("ATT", plan.att == "TP"), ("XATT", plan.xatt == "TP")) if on)
        if tp:
            out.append(("heads", 1, tp))
        if plan.mlp == "TP":
            out.append(("columns", 1, ("MLP",)))
        sp = tuple(s for s, on in (("ATT", plan.att == "SP"), ("MLP", plan.mlp == "SP"), ("CON", plan.con == "SP"))
                   if on)
        if sp:
            out.append(("tokens", 1, sp))
        dec = sp + (("XATT",) if plan.xatt == "SP" else ()) + (("HEAD",) if plan.con == "SP" else ())
        if dec:
            out.append(("decoder_tokens", 1, dec))
        return out


def search_encdec(cost: EncDecCostModel, budgets: list[float], *, top: int = 5, dp_sharding=("none",),
                  meshes=None) -> SearchResult:
    return EncDecSearcher(cost, budgets, dp_sharding=dp_sharding, meshes=meshes).run(top)

