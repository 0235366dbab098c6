"""The cost model: step time and peak memory of every rank, for any plan, from the profiles.

Time. Each Galaxy group runs its layers sub-block by sub-block; every sub-block boundary a plan
splits is a collective, so the group moves at its slowest rank there: a layer takes, forward and
backward, the sum over its sub-blocks (ATT, CON, MLP, CON) of the slowest rank's compute at its own
share (the device profile's measured table, or FLOPs / its GEMM rate), plus the layer's collectives
(the family's closed-form bytes per kind, galaxy.models.<family>, timed with the link profile).
A recomputed (activation-checkpointed) layer runs its forward again in backward, collectives
included (the forward half of the layer's collectives). Under batch_streams or comm_chunks a pass's
collectives travel behind compute: galaxy.planner.overlap_time (without them all are exposed).
Per micro-batch a pipeline stage takes
F_p = its forward + half its layers' collectives and B_p = its backward + the other half; the
stages run their m micro-batches in the schedule's order, each op waiting for its input from the
neighbouring stage (one send later; the send travels behind the sender's compute, on a link that
carries one micro-batch at a time each way): galaxy.planner.pipeline_time, which for equal stages
is (m + pp - 1)(F + B) and lets a quick stage's work hide under a slow one's. Then the once-per-step
work of each stage from its own end (both ends of a tied weight wait for each other): the Galaxy
"sum" all-reduce, DDP's all-reduce over the data-parallel replicas (not overlapped with backward),
the all-reduce of a weight tied across the pipeline's ends, the optimizer step of the rank's
parameters and, with m micro-batches, m - 1 additions of its gradients into .grad (the word
embedding's, where its rows accumulate in place, replaced by one zeroing of its .grad and each
micro-batch's rows: DeviceCompute.rows_in_place); the step ends
with the last stage to finish. Replicas with uneven rows (dp_batch_list) run their own
micro-batches of rows_d / m: each replica's pipeline is timed on its own rows, and every stage's
once-per-step work starts when its slowest replica ends (the step = the slowest replica + the DP
sync); compute and activation memory of each rank follow its replica's rows.

Under a PEFT method (galaxy.planner.method) the sub-blocks are timed as the method runs them (the
device profile's table for it: frozen weights without weight gradients, LoRA's rank-r products
in each projection's shard, the adapters in the CONs), side-tuning's backbone forward only (its
collectives too: half of them) with the side block forward and backward on the CON layout
beside every layer (and, under CON SP, its K/V all-gather, reduce-scattered in backward), and
side-only the side blocks alone. Only trained parameters are synchronised, stepped and
accumulated: DDP's all-reduce, FSDP's reduce-scatter and the Galaxy sum move their gradients
alone (kilobytes under LoRA), FSDP still gathers every weight it shards.

Memory: galaxy.planner.memory_model.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

from galaxy.distributed.comm_bytes import ring_bytes
from galaxy.plan import Plan
from galaxy.planner.comm_forms import p2p_bytes
from galaxy.planner.memory_model import MemoryModel
from galaxy.planner.model_terms import FP32, MIB
from galaxy.planner.pipeline_time import hop_time, stage_ends
from galaxy.planner.placement import is_identity, launched, placed_model
from galaxy.planner.link_model import data_parallel_traffic, link_time, wire_time
from galaxy.planner.overlap_time import overlapped_pass, pass_overlap

SUB_BLOCKS = ("ATT", "CON", "MLP", "CON")


@dataclass
class Estimate:
    plan: Plan
    step_s: float
    memory_mib: list[float]                  # per global rank
    sent_bytes: list[int]                    # per global rank and step
    compute_s: list[float]                   # per global rank: its own compute in a step
    comm_s: float                            # collectives on the critical path
    comm_rank_s: list[float] = field(default_factory=list)   # per global rank: the collectives and DP
                                             # traffic it takes part in (a pipeline's sends overlap)
    sub_block_s: list[dict] = field(default_factory=list)   # per rank: {"ATT", "CON", "MLP", ...} seconds
    # per pipeline stage (its slowest replica): one micro-batch's (forward, backward, send to the next stage)
    stage_passes: list[tuple[float, float, float]] = field(default_factory=list)

    def fits(self, budgets) -> bool:
        return all(m <= b for m, b in zip(self.memory_mib, budgets))

    def shortfall(self, budgets) -> list[float]:
        return [max(0.0, m - b) for m, b in zip(self.memory_mib, budgets)]


@dataclass
class _Step:
    """One estimate's inputs that every stage reads, and what it gathers per global rank."""
    plan: Plan
    rows: float                    # rows of one micro-batch of one replica
    forms: dict                    # the Galaxy group's collectives (CommForms)
    padded: bool                   # uneven token shares: padded gathers and scatters
    kinds: list                    # per Galaxy rank: (att kind, units), (mlp kind, units), con tokens
    hops: tuple                    # one send across each stage boundary (p to p + 1)
    carry_bytes: float             # what a stage sends forward per micro-batch
    grad_bytes: float              # what it sends back (the carry's gradient)
    compute_s: list = field(default_factory=list)
    comm_s: list = field(default_factory=list)
    sub_s: list = field(default_factory=list)
    sent: list = field(default_factory=list)
    memory: list = field(default_factory=list)


@dataclass
class _StageComm:
    mb: float = 0.0                # seconds of one micro-batch's Galaxy collectives (recomputation's too)
    fwd: float = 0.0               # the forward's half of them
    step: float = 0.0              # once per step (the Galaxy sum)
    mb_bytes: float = 0.0
    step_bytes: float = 0.0
    calls: float = 0.0             # boundary collectives of one micro-batch, and of its forward
    fwd_calls: float = 0.0
    wire: float = 0.0              # of mb, the link carrying the bytes (link_model.wire_time), and of fwd
    fwd_wire: float = 0.0


class CostModel(MemoryModel):
    """estimate(plan): step time, memory, bytes sent and compute of every rank (module docstring)."""
    times_overlap = True        # its passes take batch_streams and comm_chunks (galaxy.planner.overlap_time)

    def estimate(self, plan: Plan) -> Estimate:
        """Each replica's pipeline runs its own rows (micro-batches of rows_d / m); every stage's
        once-per-step work (DP sync, the optimizer) starts when that stage's slowest replica ends.
        A placed plan (rank_order) is timed at its positions, its figures per launch rank
        (galaxy.planner.placement)."""
        if not is_identity(plan.rank_order):
            return launched(placed_model(self, plan.rank_order).estimate(replace(plan, rank_order=None)),
                            plan.rank_order)
        g, pp, dp, m = plan.group, plan.pp, plan.dp, plan.microbatches
        kinds = [self._kinds(plan, j) for j in range(g)]
        world = g * pp * dp
        forms, padded = self._forms(plan) if g > 1 else [], len(set(plan.tokens)) > 1
        figures = ([0.0] * world, [0.0] * world, [dict() for _ in range(world)], [0.0] * world, [0.0] * world)
        ends, extras, comm_path, passes = [0.0] * pp, [0.0] * pp, 0.0, []
        for d, rows in enumerate(self.replica_rows(plan)):
            carry_bytes, grad_bytes = self.carry_bytes(rows / m * max(k[2] for k in kinds))
            hops = tuple(self._hop(plan, p, carry_bytes, d) for p in range(pp - 1))
            s = _Step(plan, rows / m, forms, padded, kinds, hops, carry_bytes, grad_bytes, *figures)
            stages = [self._stage(s, p, d) for p in range(pp)]
            fwds, bwds, own, paths = (tuple(x) for x in zip(*stages))
            replica_ends = list(stage_ends(fwds, bwds, hops, m, plan.schedule, plan.warmup))
            mine = list(zip(fwds, bwds, hops + (0.0,)))         # the slowest replica's, stage by stage
            passes = [tuple(map(max, a, b)) for a, b in zip(passes or mine, mine)]
            if pp > 1 and self.tied:        # the tied weight's all-reduce waits for both of its ends
                replica_ends[0] = replica_ends[-1] = max(replica_ends[0], replica_ends[-1])
            ends = [max(a, b) for a, b in zip(ends, replica_ends)]
            extras = [max(a, b) for a, b in zip(extras, own)]
            comm_path = max(comm_path, *paths)
        step = max(e + x for e, x in zip(ends, extras))
        return Estimate(plan, step, [x / MIB for x in s.memory], [int(x) for x in s.sent], s.compute_s, comm_path,
                        s.comm_s, s.sub_s, passes)

    def _stage(self, s: _Step, p: int, d: int) -> tuple[float, float, float, float]:
        """(forward and backward of one micro-batch of replica d on stage p, its once-per-step
        work, its communication on the critical path), filling in its ranks' figures."""
        plan, m = s.plan, s.plan.microbatches
        c = self.recomputed(plan, p)
        ranks = [(p * plan.dp + d) * plan.group + j for j in range(plan.group)]
        comm = self._stage_comm(s, p, c, tuple(ranks))
        fwd, bwd, per_rank = self._replica_compute(s, p, c, ranks)
        extra = max(self._rank_step(s, p, c, j, r, per_rank[j], comm) for j, r in enumerate(ranks))
        # Its sends are not here: they travel behind compute (galaxy.pipeline.overlap_schedule), and
        # a stage waiting for a neighbour's send idles (pipeline_time counts the wait).
        path = m * comm.mb + comm.step
        for r in ranks:
            s.comm_s[r] += path
        # batch streams and chunks hide collectives behind compute (galaxy.planner.overlap_time)
        overlap = pass_overlap(plan, s.rows, [self.devices[r] for r in ranks],
                               runs_streams=self.backbone not in ("forward", "absent"))
        return (overlapped_pass(fwd, comm.fwd, comm.fwd_calls, overlap, comm.fwd_wire),
                overlapped_pass(bwd, comm.mb - comm.fwd, comm.calls - comm.fwd_calls, overlap, comm.wire - comm.fwd_wire),
                comm.step + extra, path)

    def _stage_comm(self, s: _Step, p: int, c: int, group: tuple[int, ...]) -> _StageComm:
        """Galaxy collectives of stage p's group `group` (global ranks; c layers recomputed) per
        micro-batch (half of them in forward, the other half and the recomputed forwards' in
        backward), and once per step."""
        plan, g = s.plan, s.plan.group
        L, last = plan.stages[p], p == plan.pp - 1
        out = _StageComm()
        for kind, f, fwd_share in s.forms:
            b = s.rows * (L * f["a_layer"] + (f["a_fixed"] if last else 0))
            calls = L * f["c_layer"] + (f["c_fixed"] if last else 0)
            rb, rc = 0.5 * c * s.rows * f["a_layer"], 0.5 * c * f["c_layer"]   # recomputed forwards
            out.mb += link_time(self.link, kind, g, b + rb, calls + rc, s.padded, group)
            out.fwd += fwd_share * link_time(self.link, kind, g, b, calls, s.padded, group)
            out.mb_bytes += b + rb
            out.calls += calls + rc
            out.fwd_calls += fwd_share * calls
            out.wire += wire_time(self.link, kind, g, b + rb, group)
            out.fwd_wire += fwd_share * wire_time(self.link, kind, g, b, group)
            sb = L * f["s_layer"] + (f["s_fixed"] if last else 0)
            if sb:
                out.step += link_time(self.link, kind, g, sb, 0, ranks=group)
                out.step_bytes += sb
        if not self.trains_backbone:
            self._method_sum(plan, p, out, group)
        elif s.forms and not last and any(f["s_layer"] for _, f, _ in s.forms):
            out.step += link_time(self.link, "all_reduce", g, 0, 1, ranks=group)    # the stage's own "sum" call
        return out

    def _hop(self, plan: Plan, p: int, carry_bytes: float, d: int) -> float:
        """One micro-batch's send from stage p to stage p + 1 in replica d: every rank sends its
        counterpart the carry at once, so the slowest pair's wire time (pipeline_time.hop_time)."""
        g, dp = plan.group, plan.dp
        return hop_time(self.link, carry_bytes, [((p * dp + d) * g + j, ((p + 1) * dp + d) * g + j)
                                                 for j in range(g)])

    def _method_sum(self, plan: Plan, p: int, out: _StageComm, group: tuple[int, ...]) -> None:
        """The Galaxy group's sum of a method's trained "sum" gradients, once per step (stage p)."""
        g = plan.group
        summed = plan.stages[p] * self.summed_layer_params_of(plan, 0) + self.summed_outside_of(plan, p)
        if summed:
            b = ring_bytes("all_reduce", int(summed), FP32, g)
            out.step += link_time(self.link, "all_reduce", g, b, 1, ranks=group)
            out.step_bytes += b

    def _forms(self, plan: Plan) -> list[tuple[str, dict, float]]:
        """(kind, closed-form terms, the forward's share of their time) of the Galaxy group's
        collectives under the run's method (galaxy.planner.comm_forms; module docstring)."""
        forms = self.comm(plan.att, plan.mlp, plan.con, plan.tokens)
        if self.trains_backbone:
            return [(k, f, 0.5) for k, f in forms.items()]
        # A method's trained "sum" gradients replace full fine-tuning's (_method_sum).
        steps = dict(s_layer=0.0, s_fixed=0.0)
        if self.backward_through_backbone:
            return [(k, {**f, **steps}, 0.5) for k, f in forms.items()]
        # No backward through the backbone: the forward's half of its collectives, all in forward
        # (none in its layers when they never run); the side block's own, forward and backward.
        layer = 0.5 if self.backbone == "forward" else 0.0
        out = [(k, {**f, **steps, "a_layer": layer * f["a_layer"], "c_layer": layer * f["c_layer"],
                    "a_fixed": 0.5 * f["a_fixed"], "c_fixed": 0.5 * f["c_fixed"]}, 1.0) for k, f in forms.items()]
        if plan.con == "SP":              # K and V of the rank's tokens: [rows, s_r, 2w], padded
            kv = ring_bytes("all_gather", max(plan.tokens) * 2 * self.side_width, FP32, plan.group)
            side = dict(a_layer=kv, a_fixed=0.0, s_layer=0.0, s_fixed=0.0, c_layer=1, c_fixed=0)
            out += [("all_gather", side, 1.0), ("reduce_scatter", side, 0.0)]
        return out

    def _replica_compute(self, s: _Step, p: int, c: int, ranks: list[int]) -> tuple[float, float, list]:
        """One micro-batch on one replica's Galaxy group of stage p (c layers recomputed): (forward,
        backward) at the slowest rank of every sub-block, and each rank's own [forward, backward]."""
        plan, m = s.plan, s.plan.microbatches
        L = plan.stages[p]
        fwd = bwd = 0.0
        per_rank = [[0.0, 0.0] for _ in ranks]
        for i, sub in self._subs:
            times = []
            for j, r in enumerate(ranks):
                (ak, au), (mk, mu), con = s.kinds[j]
                kind, units = ((ak, au), ("con", con), (mk, mu), ("con", con), ("side", con))[i]
                tf, tb = self.compute[r](kind, units, s.rows)
                times.append((tf, tb))
                per_rank[j][0] += L * tf
                per_rank[j][1] += L * tb + c * tf
                s.sub_s[r][sub] = s.sub_s[r].get(sub, 0.0) + m * (L * (tf + tb) + c * tf)
            f_max, b_max = max(t[0] for t in times), max(t[1] for t in times)
            fwd += L * f_max
            bwd += L * b_max + c * f_max
        in_place = self.rows_accumulate_in_place(plan)
        for kind, label, on in (("embed", "EMB", p == 0), ("head", "HEAD", p == plan.pp - 1)):
            if on:
                times = [self.compute[r](kind, self.seq if kind == "embed" else s.kinds[j][2], s.rows)
                         for j, r in enumerate(ranks)]
                once = [0.0] * len(ranks)
                if kind == "embed" and in_place:     # the zeroed .grad once a step (_rank_step), rows per micro-batch
                    parts = [self.compute[r].rows_in_place(self.seq, s.rows) for r in ranks]
                    once = [z for z, _ in parts]
                    times = [(t[0], b) for t, (_, b) in zip(times, parts)]
                for j, r in enumerate(ranks):
                    per_rank[j][0] += times[j][0]
                    per_rank[j][1] += times[j][1]
                    s.sub_s[r][label] = s.sub_s[r].get(label, 0.0) + m * sum(times[j]) + once[j]
                fwd += max(t[0] for t in times)
                bwd += max(t[1] for t in times)
        return fwd, bwd, per_rank

    def sub_blocks(self) -> list[tuple[int, str]]:
        """(index, label) of what runs per layer: the four sub-blocks, then the side block under
        side-tuning; side-only runs the side block alone."""
        subs = [] if self.backbone == "absent" else list(enumerate(SUB_BLOCKS))
        return subs + ([(4, "SIDE")] if self.backbone in ("forward", "absent") else [])

    @functools.cached_property
    def _subs(self) -> list[tuple[int, str]]:
        return self.sub_blocks()

    def _rank_step(self, s: _Step, p: int, c: int, j: int, r: int, own: list, comm: _StageComm) -> float:
        """Rank r's once-per-step work (DDP all-reduce, the tied weight's sum, the optimizer step,
        gradient accumulation), its compute, bytes and memory; returns the once-per-step seconds."""
        plan, m = s.plan, s.plan.microbatches
        first, last = p == 0, p == plan.pp - 1
        n = self.params_of(plan, p, j)
        t = self.trainable_of(plan, p, j, n)
        d = r // plan.group - p * plan.dp          # rank r's replica
        dp_time, dp_bytes = self._dp_comm(plan, n, t, tuple((p * plan.dp + e) * plan.group + j for e in range(plan.dp)))
        if plan.pp > 1 and self.tied and (first or last):     # the tied weight's two ends sum gradients
            tied_bytes = ring_bytes("all_reduce", self.tied, FP32, 2)
            ends = (d * plan.group + j, ((plan.pp - 1) * plan.dp + d) * plan.group + j)
            dp_time += link_time(self.link, "all_reduce", 2, tied_bytes, 1, ranks=ends)
            dp_bytes += tied_bytes
        held = t / self._opt_divisor(plan)
        opt = self.devices[r].get("optimizer_s_per_param", {}).get(self.optimizer, 0.0) * held
        # every micro-batch after the first adds its gradients into .grad (autograd's
        # AccumulateGrad): a pass over what the rank's gradients hold, but for a word embedding
        # whose rows go into .grad in place (galaxy.parallel.embedding_grad; the first stage's
        # parameters stand for the table, 98% of them in all-MiniLM-L6-v2), which zeroes its .grad
        # once a step instead
        acc_held, zero = held, 0.0
        if first and self.rows_accumulate_in_place(plan):
            acc_held = max(held - self.trainable.embed, 0.0)
            zero = self.compute[r].rows_in_place(self.seq, s.rows)[0]
        acc = (m - 1) * acc_held * self.devices[r].get("grad_accumulate_s_per_param", 0.0) + zero
        s.compute_s[r] = m * sum(own) + opt + acc
        s.comm_s[r] += dp_time
        s.sent[r] = m * (comm.mb_bytes + p2p_bytes(plan.pp, first, last, s.carry_bytes, s.grad_bytes)) + \
            comm.step_bytes + dp_bytes
        s.memory[r] = self._memory(plan, p, j, r, n, s.rows, c, self.in_flight(plan, p),
                                   plan.stages[p], s.kinds[j][2], first, last)
        return dp_time + opt + acc

    def _opt_divisor(self, plan: Plan) -> int:
        return plan.dp if plan.dp_sharding != "none" and plan.dp > 1 else 1

    def _dp_comm(self, plan: Plan, n: float, t: float, ranks: tuple[int, ...]) -> tuple[float, float]:
        """Seconds and bytes of one rank's data-parallel traffic per step (n parameters held, t of
        them trained; galaxy.planner.link_model.data_parallel_traffic)."""
        return data_parallel_traffic(self.link, plan, n, t, plan.stages[0], self.backward_through_backbone, ranks)
