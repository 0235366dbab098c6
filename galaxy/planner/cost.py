"""The cost model: step time and peak memory of every rank, for any plan, from the profiles.

Time. Each Galaxy group runs its layers sub-block by sub-block; every sub-block boundary a plan
splits is a collective, so the group moves at its slowest rank there: a layer takes, forward and
backward, the sum over its sub-blocks (ATT, CON, MLP, CON) of the slowest rank's compute at its own
share (the device profile's measured table, or FLOPs / its GEMM rate), plus the layer's collectives
(the family's closed-form bytes per kind, galaxy.models.<family>, timed with the link profile).
A recomputed (activation-checkpointed) layer runs its forward again in backward, collectives
included (the forward half of the layer's collectives). Per micro-batch a pipeline stage takes
F_p = its forward + half its layers' collectives and B_p = its backward + the other half; the
stages run their m micro-batches in the schedule's order, each op waiting for its input from the
neighbouring stage (one send later): galaxy.planner.pipeline_time, which for equal stages is
(m + pp - 1)(F + B) and lets a quick stage's work hide under a slow one's. Then the once-per-step
work of each stage from its own end (both ends of a tied weight wait for each other): the Galaxy
"sum" all-reduce, DDP's all-reduce over the data-parallel replicas (not overlapped with backward),
the all-reduce of a weight tied across the pipeline's ends, the optimizer step of the rank's
parameters and, with m micro-batches, m - 1 additions of its gradients into .grad; the step ends
with the last stage to finish.

Memory, per rank (MiB): the process baseline (device profile) + parameters, gradients and optimizer
state of what the rank holds (its stage, its shares; AdamW keeps two fp32 moments, SGD none) + DDP's
gradient buckets (a second copy of the gradients, dp > 1) + the Galaxy group's buckets (a second
copy of the gradients it sums: the sequence-parallel sub-blocks' weights) + the activations saved
for backward (model profile, at the rank's shares, per row) of the micro-batches in flight (1 without a
pipeline; 1f1b: min(m, pp - stage); gpipe: m), a checkpointed layer keeping only its input carry,
plus one layer's activations while it is recomputed, plus the largest sub-block's activations again
as backward's working space + an unfused optimizer step's temporaries (AdamW: one fp32 tensor per
parameter; a fused step, the device profile's optimizer_fused, has none). On CPU the peak is
resident memory, and glibc keeps freed activation memory, so the activations count twice
(CPU_ACTIVATION_SLACK; the second time as if no layer were recomputed: backward still rebuilds
them all) and the temporaries come on top; on CUDA the larger of the two. With sharded
data parallelism (dp_sharding), parameters ("full") or not ("no_reshard", which keeps the gathered
parameters beside their shards), gradients and optimizer state are divided over the dp replicas;
the unsharded gradients before their reduce-scatter still count once, as DDP's buckets do.
"""
from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass, field
from types import SimpleNamespace

from galaxy.distributed.comm_bytes import ring_bytes
from galaxy.models.registry import family_of
from galaxy.planner.pipeline_time import stage_ends
from galaxy.planner.profiles import link_time

MIB = 2 ** 20
DDP_BUCKET_BYTES = 25 * MIB          # torch DDP's default bucket_cap_mb
OPT_STATE = {"adamw": 2, "sgd": 0}   # fp32 tensors per parameter the optimizer keeps
OPT_TEMP = {"adamw": 1, "sgd": 0}    # fp32 temporaries per parameter of an unfused step (AdamW: sqrt(v))
# CPU peak RSS: glibc keeps most freed activation memory in its heap, and backward's gradients of
# activations come on top: activations x (1 + slack), then + an unfused optimizer's temporaries.
# Measured with the fused step on all-MiniLM-L6-v2 (bench/plan_accuracy.py, 8 x 64 tokens, 16 plans):
# slack 1.0 puts all 31 ranks within 10% (median 2.4%); 0.5 left plans with few activations (pipeline
# stages, accumulation, recomputation) 9-11% under. A device profile may set its own
# "activation_slack". CUDA (caching allocator): max(acts, temps).
CPU_ACTIVATION_SLACK = 1.0
FP32 = 4


@dataclass(frozen=True)
class Plan:
    """Every choice of a plan; shares are per Galaxy rank (every group uses the same lists)."""
    pp: int
    dp: int
    att: str                       # TP | SP
    mlp: str                       # TP | SP
    con: str                       # SP | None
    heads: tuple[int, ...]         # query heads per Galaxy rank
    columns: tuple[int, ...]       # MLP columns per Galaxy rank
    tokens: tuple[int, ...]        # tokens per Galaxy rank
    stages: tuple[int, ...]        # layers per pipeline stage
    microbatches: int = 1          # pipeline micro-batches (pp > 1) or grad_accum_steps (pp 1)
    schedule: str = "1f1b"
    checkpoint: tuple[int, ...] = ()   # leading layers of each stage that recompute (len pp)
    dp_sharding: str = "none"

    @property
    def group(self) -> int:
        return len(self.tokens)

    def ckpt(self, p: int) -> int:
        return self.checkpoint[p] if self.checkpoint else 0

    def key(self) -> tuple:
        return (self.pp, self.dp, self.att, self.mlp, self.con, self.heads, self.columns, self.tokens,
                self.stages, self.microbatches, self.schedule, self.checkpoint, self.dp_sharding)


@dataclass
class Estimate:
    plan: Plan
    step_s: float
    memory_mib: list[float]                  # per global rank
    sent_bytes: list[int]                    # per global rank and step
    compute_s: list[float]                   # per global rank: its own compute in a step
    comm_s: float                            # collectives and sends on the critical path
    sub_block_s: list[dict] = field(default_factory=list)   # per rank: {"ATT", "CON", "MLP", ...} seconds

    def fits(self, budgets) -> bool:
        return all(m <= b for m, b in zip(self.memory_mib, budgets))

    def shortfall(self, budgets) -> list[float]:
        return [max(0.0, m - b) for m, b in zip(self.memory_mib, budgets)]


def _interp(xs, ys, x):
    """Piecewise linear through (xs, ys), extended linearly past both ends; one point: constant."""
    if len(xs) == 1:
        return ys[0]
    i = bisect.bisect_left(xs, x)
    i = min(max(i, 1), len(xs) - 1)
    x0, x1 = xs[i - 1], xs[i]
    return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - x0) / (x1 - x0)


class DeviceCompute:
    """Seconds one device spends on a sub-block kind at a share: its measured table when the
    profile has one for this model, else the model profile's FLOPs over its GEMM rate."""

    FLOPS_OF = {"att_tp": "att", "att_sp": "att", "mlp_tp": "mlp", "mlp_sp": "mlp", "con": "con",
                "head": "head", "embed": None}

    def __init__(self, device: dict, model: dict, use_tables: bool):
        self.device, self.model = device, model
        compute = device.get("compute") if use_tables else None
        self.tables = compute["kinds"] if compute else {}
        self.rows = compute["rows"] if compute else []
        self.rate = device.get("gemm_flops_per_s")
        self.ew_rate = device.get("elementwise_flops_per_s")
        self._cache: dict = {}

    def __call__(self, kind: str, units: int, rows: float) -> tuple[float, float]:
        key = (kind, units, rows)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = self._table(kind, units, rows) if kind in self.tables \
                else self._flops(kind, units, rows)
        return hit

    def _table(self, kind, units, rows):
        t = self.tables[kind]
        out = []
        for grid in (t["fwd_s"], t["bwd_s"]):
            per_unit = [_interp(self.rows, row, rows) for row in grid]
            out.append(max(0.0, _interp(t["units"], per_unit, units)))
        return tuple(out)

    def _flops(self, kind, units, rows):
        name = self.FLOPS_OF[kind]
        if name is None or self.rate is None:
            return 0.0, 0.0
        f = self.model["flops_per_row"][name]
        total = self.model["units"][kind][0]
        frac = 1.0 if kind == "head" and self.model["task"] == "classification" else units / total
        ew = self.ew_rate
        fwd = f["fwd"] / self.rate + (f["fwd_elementwise"] / ew if ew else 0.0)
        bwd = f["bwd"] / self.rate + (f["bwd_elementwise"] / ew if ew else 0.0)
        return fwd * rows * frac, bwd * rows * frac


class CommForms:
    """The family's closed-form bytes and calls per collective kind, split into the part that
    scales with rows and layers (moved by every micro-batch) and the once-per-step part.

    bytes(b rows, L layers) = b L a_layer + b a_fixed + L s_layer + s_fixed, read off the closed
    form at b, L in {1, 2}; calls come from the same evaluations (per micro-batch)."""

    def __init__(self, model: dict):
        self.spec = family_of(model["model_type"])
        self.hf = dict(model["hf_config"])
        self._cache: dict = {}

    def __call__(self, att: str, mlp: str, con: str, tokens: tuple[int, ...]) -> dict:
        key = (att, mlp, con, tokens)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = self._forms(SimpleNamespace(att=att, mlp=mlp, con=con), tokens)
        return hit

    def _forms(self, plan, tokens) -> dict:
        f = {}
        for b in (1, 2):
            for layers in (1, 2):
                cfg = SimpleNamespace(**{**self.hf, "num_hidden_layers": layers})
                f[b, layers] = self.spec.plan_comm_bytes(plan, cfg, b, list(tokens))
        out = {}
        for kind in set().union(*(d.keys() for d in f.values())):
            v = {k: f[k].get(kind, {"sent": 0, "calls": 0}) for k in f}
            s = {k: v[k]["sent"] for k in v}
            a_layer = s[2, 2] - s[1, 2] - s[2, 1] + s[1, 1]
            a_fixed = s[2, 1] - s[1, 1] - a_layer
            s_layer = s[1, 2] - s[1, 1] - a_layer
            s_fixed = s[1, 1] - a_layer - a_fixed - s_layer
            c_layer = v[1, 2]["calls"] - v[1, 1]["calls"]
            out[kind] = dict(a_layer=a_layer, a_fixed=a_fixed, s_layer=s_layer, s_fixed=s_fixed,
                             c_layer=c_layer, c_fixed=v[1, 1]["calls"] - c_layer)
        return out


class CostModel:
    def __init__(self, model: dict, devices: list[dict], link: dict | None, *, batch_size: int,
                 optimizer: str = "adamw"):
        self.model, self.devices, self.link = model, devices, link
        self.batch = batch_size
        self.optimizer = optimizer
        self.world = len(devices)
        self.seq = model["pad_size"]
        self.hidden = model["hf_config"]["hidden_size"]
        self.layers = model["hf_config"]["num_hidden_layers"]
        signature = model_signature(model)
        self.compute = [DeviceCompute(d, model, tables_match(d, signature)) for d in devices]
        self.comm = CommForms(model)
        p = model["params"]
        self.embed_params, self.head_params, self.tied = p["embed"], p["head"], p["tied"]
        self.other_params = p.get("other", 0)
        self.layer_params = p["layer"]
        self.acts = model["act_bytes_per_row"]
        self.carry = model["carry_tensors"]

    # --- per rank, per micro-batch -------------------------------------------------------------

    def _kinds(self, plan: Plan, j: int):
        """(att kind, units), (mlp kind, units), con tokens of Galaxy rank j."""
        att = ("att_tp", plan.heads[j]) if plan.att == "TP" or plan.group == 1 else ("att_sp", plan.tokens[j])
        mlp = ("mlp_tp", plan.columns[j]) if plan.mlp == "TP" or plan.group == 1 else ("mlp_sp", plan.tokens[j])
        con = plan.tokens[j] if plan.con == "SP" and plan.group > 1 else self.seq
        return att, mlp, con

    def _kind_params(self, kind: str, units: int) -> float:
        """Parameters of one sub-block kind at a share (the model profile: [c0, c1] or a constant)."""
        v = self.layer_params[kind]
        return v[0] + v[1] * units if isinstance(v, list) else v

    def layer_params_of(self, plan: Plan, j: int) -> float:
        (ak, au), (mk, mu), _ = self._kinds(plan, j)
        return self._kind_params(ak, au) + self._kind_params(mk, mu) + self.layer_params["con"]

    def summed_layer_params_of(self, plan: Plan, j: int) -> float:
        """Parameters of one layer at rank j whose gradients the Galaxy group sums (galaxy.parallel.
        grad_sync: the sequence-parallel sub-blocks' weights, which saw only this rank's tokens)."""
        if plan.group == 1:
            return 0.0
        (ak, au), (mk, mu), _ = self._kinds(plan, j)
        return ((self._kind_params(ak, au) if ak == "att_sp" else 0.0)
                + (self._kind_params(mk, mu) if mk == "mlp_sp" else 0.0)
                + (self.layer_params["con"] if plan.con == "SP" else 0.0))

    def params_of(self, plan: Plan, p: int, j: int) -> float:
        n = plan.stages[p] * self.layer_params_of(plan, j) + self.other_params
        if p == 0:
            n += self.embed_params
        if p == plan.pp - 1:
            n += self.head_params
        if plan.pp == 1:
            n -= self.tied
        return n

    def _act(self, kind: str, units: float) -> float:
        c0, c1 = self.acts[kind]
        return c0 + c1 * units

    def layer_act_per_row(self, plan: Plan, j: int) -> tuple[float, float]:
        """(bytes a layer saves per row, the largest sub-block's) at rank j's shares."""
        (ak, au), (mk, mu), con = self._kinds(plan, j)
        parts = (self._act(ak, au), self._act(mk, mu), self._act("con", con), self._act("con", con))
        return sum(parts), max(parts)

    def stage_ranks(self, plan: Plan, p: int) -> list[int]:
        g, dp = plan.group, plan.dp
        return [(p * dp + d) * g + j for d in range(dp) for j in range(g)]

    def estimate_memory(self, plan: Plan) -> list[float]:
        """MiB per rank (the memory half of estimate(), cheaper)."""
        g, pp, m = plan.group, plan.pp, plan.microbatches
        rows = self.batch / (plan.dp * m)
        s_con = [self._kinds(plan, j)[2] for j in range(g)]
        out = [0.0] * (g * pp * plan.dp)
        for p in range(pp):
            inflight = 1 if pp == 1 else (m if plan.schedule == "gpipe" else min(m, pp - p))
            for j in range(g):
                n = self.params_of(plan, p, j)
                for d in range(plan.dp):
                    r = (p * plan.dp + d) * g + j
                    out[r] = self._memory(plan, p, j, r, n, rows, plan.ckpt(p), inflight, plan.stages[p],
                                          s_con[j], p == 0, p == pp - 1) / MIB
        return out

    def _memory(self, plan, p, j, r, n, rows, c, inflight, L, s_con, first, last) -> float:
        """Bytes of rank r (stage p, Galaxy rank j, n parameters) at its peak."""
        dev = self.devices[r]
        state, acts, temp = self._memory_parts(plan, p, j, n, rows, c, inflight, L, s_con, first, last)
        if dev.get("optimizer_fused"):                # one kernel per tensor group: no temporaries
            temp = 0.0
        if dev.get("device", "cpu") == "cuda":       # the caching allocator reuses freed activations
            return dev.get("baseline_mib", 0.0) * MIB + state + max(acts, temp)
        slack = dev.get("activation_slack", CPU_ACTIVATION_SLACK)
        # The slack stands for what backward touches beside the saved activations (their gradients,
        # freed blocks the heap keeps), and backward still walks every layer's activations when it
        # rebuilds them: recomputation saves the saved activations once, not 1 + slack times
        # (bench/plan_accuracy.py: Galaxy with every layer recomputed measured 751-760 MiB against
        # 684 predicted at 1 + slack; serial 834, 794 predicted, 880 now).
        whole = acts if not c else \
            self._memory_parts(plan, p, j, n, rows, 0, inflight, L, s_con, first, last)[1]
        kept = 0.0
        if dev.get("freed_memory_kept") and first:
            # Each accumulated micro-batch after the first makes a fresh dense embedding gradient and
            # adds it into .grad; a heap that keeps freed memory (galaxy.runtime.cpu_allocator) keeps
            # that block too, split by later small allocations, so the next one extends the heap
            # (bench/plan_accuracy.py: pp 2, 4 micro-batches, stage 0 measured 851-885 MiB against
            # 747 predicted without this term).
            kept = (plan.microbatches - 1) * self.embed_params * FP32
        return dev.get("baseline_mib", 0.0) * MIB + state + acts + slack * whole + temp + kept

    # --- the estimate -------------------------------------------------------------------------------

    def estimate(self, plan: Plan) -> Estimate:
        g, pp, dp, m = plan.group, plan.pp, plan.dp, plan.microbatches
        rows = self.batch / (dp * m)
        forms = self.comm(plan.att, plan.mlp, plan.con, plan.tokens) if g > 1 else {}
        padded = len(set(plan.tokens)) > 1          # uneven token shares: padded gathers and scatters
        kinds_of = [self._kinds(plan, j) for j in range(g)]
        s_con = [k[2] for k in kinds_of]
        carry_bytes = self.carry * rows * max(s_con) * self.hidden * FP32
        world = g * pp * dp
        compute_s = [0.0] * world
        sub_s = [dict() for _ in range(world)]
        sent = [0.0] * world
        memory = [0.0] * world
        stage_fwd, stage_bwd, extras = [], [], []     # per stage: one micro-batch's F and B; once per step
        hop = link_time(self.link, "send_recv", 2, carry_bytes, 1) if pp > 1 else 0.0   # one stage-to-stage send
        comm_path = 0.0
        for p in range(pp):
            L, c = plan.stages[p], plan.ckpt(p)
            first, last = p == 0, p == pp - 1
            # Galaxy collectives of this stage per micro-batch (half of them in forward, the other
            # half and the recomputed forwards' in backward), and once per step.
            mb_comm = fwd_comm = step_comm = 0.0
            mb_bytes = step_bytes = 0.0
            for kind, f in forms.items():
                b = rows * (L * f["a_layer"] + (f["a_fixed"] if last else 0))
                calls = L * f["c_layer"] + (f["c_fixed"] if last else 0)
                rb, rc = 0.5 * c * rows * f["a_layer"], 0.5 * c * f["c_layer"]   # recomputed forwards
                mb_comm += link_time(self.link, kind, g, b + rb, calls + rc, padded)
                fwd_comm += 0.5 * link_time(self.link, kind, g, b, calls, padded)
                mb_bytes += b + rb
                sb = L * f["s_layer"] + (f["s_fixed"] if last else 0)
                if sb:
                    step_comm += link_time(self.link, kind, g, sb, 0)
                    step_bytes += sb
            if forms and not last and any(f["s_layer"] for f in forms.values()):
                step_comm += link_time(self.link, "all_reduce", g, 0, 1)     # the stage's own "sum" call
            p2p = ((0 if last else 1) + (0 if first else 1)) * hop     # this stage's sends per micro-batch
            worst_fwd = worst_bwd = 0.0
            stage_extra = 0.0
            inflight = 1 if pp == 1 else (m if plan.schedule == "gpipe" else min(m, pp - p))
            for d in range(dp):
                ranks = [(p * dp + d) * g + j for j in range(g)]
                fwd = bwd = 0.0
                per_rank = [[0.0, 0.0] for _ in range(g)]       # fwd, bwd of one micro-batch
                labels = ("ATT", "CON", "MLP", "CON")
                for i, sub in enumerate(labels):
                    times = []
                    for j, r in enumerate(ranks):
                        (ak, au), (mk, mu), con = kinds_of[j]
                        kind, units = ((ak, au), ("con", con), (mk, mu), ("con", con))[i]
                        tf, tb = self.compute[r](kind, units, rows)
                        times.append((tf, tb))
                        per_rank[j][0] += L * tf
                        per_rank[j][1] += L * tb + c * tf
                        sub_s[r][sub] = sub_s[r].get(sub, 0.0) + m * (L * (tf + tb) + c * tf)
                    f_max, b_max = max(t[0] for t in times), max(t[1] for t in times)
                    fwd += L * f_max
                    bwd += L * b_max + c * f_max
                for kind, on in (("embed", first), ("head", last)):
                    if not on:
                        continue
                    times = []
                    for j, r in enumerate(ranks):
                        units = self.seq if kind == "embed" else s_con[j]
                        tf, tb = self.compute[r](kind, units, rows)
                        times.append((tf, tb))
                        per_rank[j][0] += tf
                        per_rank[j][1] += tb
                        label = "EMB" if kind == "embed" else "HEAD"
                        sub_s[r][label] = sub_s[r].get(label, 0.0) + m * (tf + tb)
                    fwd += max(t[0] for t in times)
                    bwd += max(t[1] for t in times)
                worst_fwd, worst_bwd = max(worst_fwd, fwd), max(worst_bwd, bwd)
                # once per step on each rank: DDP all-reduce, optimizer, and its memory
                for j, r in enumerate(ranks):
                    compute_s[r] = m * sum(per_rank[j])
                    n = self.params_of(plan, p, j)
                    dp_time, dp_bytes = self._dp_comm(plan, n)
                    if pp > 1 and self.tied and (first or last):     # the tied weight's two ends sum gradients
                        tied_bytes = ring_bytes("all_reduce", self.tied, FP32, 2)
                        dp_time += link_time(self.link, "all_reduce", 2, tied_bytes, 1)
                        dp_bytes += tied_bytes
                    opt = self.devices[r].get("optimizer_s_per_param", {}).get(self.optimizer, 0.0) * n
                    opt /= self._opt_divisor(plan)
                    # every micro-batch after the first adds its gradients into .grad (autograd's
                    # AccumulateGrad): a pass over what the rank's gradients hold
                    acc = (m - 1) * n / self._opt_divisor(plan) * \
                        self.devices[r].get("grad_accumulate_s_per_param", 0.0)
                    compute_s[r] += opt + acc
                    stage_extra = max(stage_extra, dp_time + opt + acc)
                    sent[r] = m * (mb_bytes + p2p_bytes(pp, first, last, carry_bytes)) + step_bytes + dp_bytes
                    memory[r] = self._memory(plan, p, j, r, n, rows, c, inflight, L, s_con[j], first, last)
            comm_path = max(comm_path, m * (mb_comm + p2p) + step_comm)
            stage_fwd.append(worst_fwd + fwd_comm)
            stage_bwd.append(worst_bwd + mb_comm - fwd_comm)
            extras.append(step_comm + stage_extra)
        ends = list(stage_ends(tuple(stage_fwd), tuple(stage_bwd), hop, m, plan.schedule))
        if pp > 1 and self.tied:        # the tied weight's all-reduce waits for both of its ends
            ends[0] = ends[-1] = max(ends[0], ends[-1])
        step = max(e + x for e, x in zip(ends, extras))
        return Estimate(plan, step, [x / MIB for x in memory], [int(x) for x in sent], compute_s, comm_path, sub_s)

    def _opt_divisor(self, plan: Plan) -> int:
        return plan.dp if plan.dp_sharding != "none" and plan.dp > 1 else 1

    def _dp_comm(self, plan: Plan, n: float) -> tuple[float, float]:
        """Seconds and bytes of one rank's data-parallel gradient traffic per step."""
        dp = plan.dp
        if dp <= 1:
            return 0.0, 0.0
        if plan.dp_sharding == "none":
            b = ring_bytes("all_reduce", int(n), FP32, dp)
            calls = max(1, math.ceil(n * FP32 / DDP_BUCKET_BYTES))
            return link_time(self.link, "all_reduce", dp, b, calls), b
        shard = int(math.ceil(n / dp))
        gathers = 2 * plan.microbatches if plan.dp_sharding == "full" else 1
        ag = ring_bytes("all_gather", shard, FP32, dp)
        rs = ring_bytes("reduce_scatter", shard, FP32, dp)
        t = link_time(self.link, "all_gather", dp, gathers * ag, gathers * plan.stages[0]) + \
            link_time(self.link, "reduce_scatter", dp, rs, plan.stages[0])
        return t, gathers * ag + rs

    @functools.lru_cache(maxsize=65536)
    def _memory_parts(self, plan, p, j, n, rows, c, inflight, L, s_con, first, last) -> tuple[float, float, float]:
        """(weights, gradients, optimizer state and the buckets' gradient copies; activations at the
        backward's peak; an unfused optimizer step's temporaries) in bytes."""
        dp = plan.dp
        sharded = plan.dp_sharding != "none" and dp > 1
        weights = n / dp if sharded else n
        if sharded and plan.dp_sharding == "full":
            weights += 2 * self.layer_params_of(plan, j)          # a layer gathered, the next prefetched
        elif sharded:                                             # no_reshard: the gathered parameters stay
            weights += n                                          # beside their shards until the step ends
        held = n / dp if sharded else n                           # what grads and optimizer state cover
        opt = OPT_STATE.get(self.optimizer, 0) * held
        # A second copy of the gradients: DDP's buckets (its gradients are views of them, but
        # backward makes each gradient afresh after zero_grad(set_to_none) and the bucket takes a copy);
        # under sharding, each unit's unsharded gradients before their reduce-scatter (freed unit by
        # unit, but the allocator keeps the memory: bench/plan_memory.py measured 929 MiB where the
        # shards alone predicted 728).
        buckets = n if dp > 1 else 0
        # The Galaxy group's "sum" gradients are flattened into their all-reduce buckets: one more
        # copy, in buffers GradientSync keeps from step to step.
        buckets += L * self.summed_layer_params_of(plan, j) / (dp if sharded else 1)
        layer, biggest = self.layer_act_per_row(plan, j)
        carry = self.carry * s_con * self.hidden * FP32
        per_mb = (L - c) * layer + c * carry
        if first:
            per_mb += self._act("embed", self.seq)
        if last:
            per_mb += self._act("head", s_con)
        acts = rows * (inflight * per_mb + (layer if c else 0) + biggest)
        temp = OPT_TEMP.get(self.optimizer, 0) * held * FP32
        return FP32 * (weights + held + opt + buckets), acts, temp


def p2p_bytes(pp: int, first: bool, last: bool, carry_bytes: float) -> float:
    if pp == 1:
        return 0.0
    return ((0 if last else 1) + (0 if first else 1)) * carry_bytes


def model_signature(model: dict) -> dict:
    """What a device's compute table must have been measured at to apply to this model."""
    hf = model["hf_config"]
    return {"model_type": hf.get("model_type"), "hidden_size": hf.get("hidden_size"),
            "num_attention_heads": hf.get("num_attention_heads"),
            "num_key_value_heads": hf.get("num_key_value_heads") or hf.get("num_attention_heads"),
            "intermediate_size": hf.get("intermediate_size"), "vocab_size": hf.get("vocab_size"),
            "pad_size": model["pad_size"]}


def tables_match(device: dict, signature: dict) -> bool:
    compute = device.get("compute")
    return bool(compute) and all(compute.get("model", {}).get(k) == v for k, v in signature.items())
