"""The cost model of an encoder-decoder plan (BART, T5): step time and peak memory per rank, from
a version-2 model profile (galaxy.planner.encdec_profile) and the devices profile, for full
fine-tuning or a PEFT method (the profile's "peft" section, galaxy.planner.encdec_method).

Any pipeline (stages split the encoder's layers then the decoder's: a stage may hold both), any
data-parallel degree, plain or sharded (dp_sharding). The plan's encoder layers run at the source
shares (tokens) and the decoder's at the target shares (decoder_tokens), XATT by its own method:

  time     per micro-batch, each sub-block at its slowest rank (FLOPs at the rank's share over its
           device's GEMM rate: the devices' compute tables hold no decoder kinds yet), the
           encoder's L_e x (ATT, CON, MLP, CON) and the decoder's L_d x (ATT, CON, XATT, CON, MLP,
           CON), the embeddings and the head; plus the group's collectives of the family's closed
           form (galaxy.models.encdec_forms, bytes per kind, split into per-row and once-per-step
           parts), timed on the link; then the data-parallel traffic, the optimizer step and, with
           m micro-batches, m - 1 additions into .grad. The first stage's shared table's backward
           (table_backward): a zeroed [vocab, d_model] block plus the looked-up rows each
           micro-batch where the lookup stays dense; where its rows accumulate in place
           (galaxy.parallel.embedding_grad) the block is zeroed once a step, each micro-batch adds
           only its rows, and the table leaves the m - 1 additions.
  pipeline each stage's layers as above (its own layers' collectives; the parts outside the
           layers on the last stage; the memory's gather on every stage holding decoder layers),
           the stages played through the schedule (galaxy.planner.pipeline_time), each hop its
           boundary's send (boundary_bytes: galaxy.pipeline.carry's tensors) over the slowest
           pair of ranks across it, and the tied embedding's gradient summed between the ends.
  methods  a sub-block's FLOPs are the closed form's plus the method's difference to full
           fine-tuning (torch's count of both: LoRA's rank-r products, a frozen weight's missing
           weight gradient); side-tuning's backbone runs forward only (half of its collectives,
           its per-row ones all in forward) and each layer's side layer runs beside it, forward
           and backward, its K/V gathered over the group under CON SP; side-only runs the side
           layers alone. The Galaxy sum and the data-parallel traffic carry the trained
           parameters' gradients only; FSDP still gathers every weight (once more in backward
           where backward runs through the backbone, each micro-batch under "full").
  memory   galaxy.planner.encdec_terms.

XATT under SP projects the whole memory's K/V on every rank (S source tokens): its FLOPs are the
memory's part (`fwd_memory`) plus the rest at the rank's share of target tokens.
"""
from __future__ import annotations

import functools
from types import SimpleNamespace

from galaxy.distributed.comm_bytes import ring_bytes, tally
from galaxy.models.registry import family_of
from galaxy.plan import Plan
from galaxy.planner.cost import Estimate
from galaxy.planner.encdec_bench import with_layers
from galaxy.planner.encdec_terms import EncDecTerms
from galaxy.planner.model_terms import FP32, MIB
from galaxy.planner.link_model import data_parallel_traffic, link_time
from galaxy.planner.pipeline_time import hop_time, stage_ends

ENCODER_SUBS = ("att", "con", "mlp", "con")
DECODER_SUBS = ("att", "con", "xatt", "con", "mlp", "con")
STACK_SUBS = {"encoder": ENCODER_SUBS, "decoder": DECODER_SUBS}


class EncDecCostModel(EncDecTerms):
    def __init__(self, model: dict, devices: list[dict], link: dict | None, *, batch_size: int,
                 optimizer: str = "adamw", method: dict | None = None):
        super().__init__(model, devices, link, batch_size=batch_size, optimizer=optimizer, method=method)
        self.family = family_of(model["model_type"])
        self.num_labels = model.get("num_labels") if model["task"] == "classification" else None
        self._hf = _hf_config(model["hf_config"])

    def subs(self, stack: str) -> tuple[str, ...]:
        """What one layer of `stack` runs: its backbone's sub-blocks (none under side-only), then
        the side layer under side-tuning."""
        backbone = () if self.backbone == "absent" else STACK_SUBS[stack]
        return backbone + (("side",) if self.backbone in ("forward", "absent") else ())

    # --- compute ---------------------------------------------------------------------------------

    def sub_flops(self, stack: str, sub: str) -> tuple[float, float]:
        """(forward, backward) FLOPs per row of one whole sub-block under the run's method."""
        f = self.stacks[stack]["flops_per_row"].get(sub, {"fwd": 0.0, "bwd": 0.0})
        if self.section is None:
            return f["fwd"], f["bwd"]
        method = self.section["stacks"][stack]
        m = method["flops_per_row"][sub]
        if sub == "side":
            return m["fwd"], m["bwd"]
        ref = method["full_flops_per_row"][sub]
        bwd = f["bwd"] - (ref["bwd"] - m["bwd"]) if self.backward_through_backbone else 0.0
        return f["fwd"] + m["fwd"] - ref["fwd"], bwd

    def flops_time(self, r: int, stack: str, kind: str, units: int, rows: float) -> tuple[float, float]:
        """(forward, backward) seconds of one sub-block kind of a stack on device r."""
        rate = self.devices[r].get("gemm_flops_per_s")
        if not rate:
            return 0.0, 0.0
        section = self.stacks[stack]
        sub = kind.split("_")[0]
        f_fwd, f_bwd = self.sub_flops(stack, sub)
        total = section["units"][kind][0] if kind in section["units"] else section["tokens"]
        fixed = section["flops_per_row"][sub].get("fwd_memory", 0) if kind == "xatt_sp" else 0   # the memory's K/V
        fwd = fixed + (f_fwd - fixed) * units / total
        bwd = fwd * f_bwd / f_fwd if f_fwd else 0.0        # the closed forms: twice the forward
        return fwd / rate * rows, bwd / rate * rows

    def _ends_time(self, r: int, plan: Plan, j: int, rows: float) -> tuple[float, float]:
        """The head on the rank's target tokens (the classifier: on each row's pooled token)."""
        rate = self.devices[r].get("gemm_flops_per_s")
        f = (self.section or {}).get("head_flops_per_row") or self.model["flops_per_row"]["head"]
        share = plan.decoder_tokens[j] / self.target if plan.con == "SP" and plan.group > 1 else 1.0
        share = 1.0 if self.num_labels is not None else share
        return (f["fwd"] / rate * rows * share, f["bwd"] / rate * rows * share) if rate else (0.0, 0.0)

    # --- communication -----------------------------------------------------------------------------

    @functools.lru_cache(maxsize=4096)
    def stage_forms(self, plan: Plan, p: int) -> dict:
        """kind -> (wire bytes per row of a micro-batch, once per step, calls per micro-batch) of
        stage p's group collectives: the family's closed form of its layers at 1 and 2 rows, the
        parts outside the layers (the memory's gather, the ends, the sum of what lies before the
        layers) on the last stage, and the memory's gather again on every other stage holding
        decoder layers. Under a method the per-row part is as the backbone runs (forward only:
        half; side-only: none) plus the side layers' K/V gathers, the once-a-step part the trained
        "sum" gradients' all-reduce."""
        if plan.group == 1:
            return {}
        (enc, _), (dec, _) = self.stage_stacks(plan, p).values()
        last = p == plan.pp - 1
        out = self._closed(plan, enc, dec, last)
        if not last and dec:
            memory = plan.con == "SP"
            numel = max(plan.tokens) * self.hidden if memory else self.source * self.hidden
            calls = [("all_gather", numel, 1), ("reduce_scatter", numel, 1)] if memory else [("all_reduce", numel, 1)]
            for kind, c in tally(calls, plan.group).items():
                a, st, n = out.get(kind, (0.0, 0, 0))
                out[kind] = (a + c["sent"], st, n + c["calls"])
        runs = 1.0 if self.backward_through_backbone else 0.5 if self.backbone == "forward" else 0.0
        out = {kind: (runs * a, st if self.trains_backbone else 0, round(runs * n)) for kind, (a, st, n) in out.items()}
        if not self.trains_backbone and self.summed_of(plan, p):
            a, st, n = out.get("all_reduce", (0.0, 0, 0))
            out["all_reduce"] = (a, st + ring_bytes("all_reduce", int(self.summed_of(plan, p)), FP32, plan.group), n)
        if self.side_width and plan.con == "SP":       # each side layer's K and V: [rows, t_r, 2w], padded
            kv = sum(layers * ring_bytes("all_gather", max(shares) * 2 * self.side_width, FP32, plan.group)
                     for layers, shares in ((enc, plan.tokens), (dec, plan.decoder_tokens)))
            for kind in ("all_gather", "reduce_scatter"):
                a, st, n = out.get(kind, (0.0, 0, 0))
                out[kind] = (a + kv, st, n + enc + dec)
        return out

    def _closed(self, plan: Plan, enc: int, dec: int, ends: bool) -> dict:
        """kind -> (per row, once a step, calls) of the closed form for enc + dec layers, with
        (ends) or without the parts outside the layers."""
        def at(b, e, d):
            return self.family.plan_comm_bytes(plan, self._hf_with(e, d), b, list(plan.tokens),
                                               num_labels=self.num_labels)
        forms = {b: at(b, enc, dec) for b in (1, 2)}
        fixed = {b: at(b, 0, 0) for b in (1, 2)} if not ends else {1: {}, 2: {}}
        out = {}
        zero = {"sent": 0, "calls": 0}
        for kind in set(forms[1]) | set(forms[2]):
            s1, s2 = (forms[b].get(kind, zero)["sent"] - fixed[b].get(kind, zero)["sent"] for b in (1, 2))
            calls = forms[1].get(kind, zero)["calls"] - fixed[1].get(kind, zero)["calls"]
            out[kind] = (s2 - s1, s1 - (s2 - s1), calls)
        return out

    @functools.lru_cache(maxsize=256)
    def _hf_with(self, encoder: int, decoder: int):
        return with_layers(self._hf, encoder, decoder)

    def _dp(self, plan: Plan, n: float, t: float, p: int = 0) -> tuple[float, float]:
        """Seconds and bytes of a rank's data-parallel traffic a step (n held, t trained on stage
        p; galaxy.planner.link_model.data_parallel_traffic)."""
        return data_parallel_traffic(self.link, plan, n, t, plan.stages[p], self.backward_through_backbone)

    def table_backward(self, plan: Plan, r: int, rows: float) -> tuple[float, float]:
        """The shared table's backward on first-stage rank r: (seconds once a step, seconds per
        micro-batch). No compute table measures an encoder-decoder's embedding, so both parts
        are passes over their elements at the device's grad_accumulate_s_per_param (a stand-in:
        zeroing writes where an addition reads two and writes one, so it errs high): the
        [vocab, d_model] block's zeroing, and the rows x (S + T) looked-up rows of d_model added
        into it. Dense: both each micro-batch; rows in place: the zeroing once a step."""
        if not self.table_trains:
            return 0.0, 0.0
        rate = self.devices[r].get("grad_accumulate_s_per_param", 0.0)
        zero, looked_up = self.table * rate, rows * (self.source + self.target) * self.hidden * rate
        return (zero, looked_up) if self.rows_accumulate_in_place(plan) else (0.0, zero + looked_up)

    # --- the step --------------------------------------------------------------------------------------

    def estimate(self, plan: Plan) -> Estimate:
        g, pp, m = plan.group, plan.pp, plan.microbatches
        rows = self.batch / (plan.dp * m)
        padded = len(set(plan.tokens)) > 1 or len(set(plan.decoder_tokens)) > 1
        out = _Out(self.world)
        bounds = [self.boundary_bytes(plan, sum(plan.stages[:p + 1]), rows) for p in range(pp - 1)]
        hops = tuple(self._hop(plan, p, bounds[p][0]) for p in range(pp - 1))
        fwds, bwds, extras, comm_path = [], [], [], 0.0
        for p in range(pp):
            forms = self.stage_forms(plan, p)
            mb = sum(link_time(self.link, kind, g, rows * a, calls, padded) for kind, (a, _, calls) in forms.items())
            step = sum(link_time(self.link, kind, g, st, 0) for kind, (_, st, _) in forms.items() if st)
            group_bytes = sum(m * rows * a + st for a, st, _ in forms.values())
            sends = (0 if p == pp - 1 else bounds[p][0]) + (0 if p == 0 else bounds[p - 1][1])
            fwd = bwd = 0.0
            for d in range(plan.dp):
                f, b = self._replica(plan, p, [(p * plan.dp + d) * g + j for j in range(g)], rows, out)
                fwd, bwd = max(fwd, f), max(bwd, b)
            fwds.append(fwd + mb / 2)
            bwds.append(bwd + mb / 2)
            path = m * mb + step        # sends travel behind compute (waiting for one: pipeline_time)
            comm_path = max(comm_path, path)
            extras.append(step + max(self._rank_step(plan, p, r, rows, path, m * sends + group_bytes, out)
                                     for r in self.stage_ranks(plan, p)))
        ends = list(stage_ends(tuple(fwds), tuple(bwds), hops, m, plan.schedule, plan.warmup))
        if pp > 1 and self.outside_counts(True)["tied"]:     # the tied weight's sum waits for both ends
            ends[0] = ends[-1] = max(ends[0], ends[-1])
        step = max(e + x for e, x in zip(ends, extras))
        return Estimate(plan, step, out.memory, [int(b) for b in out.sent], out.compute, comm_path, out.comm,
                        out.sub_s)

    def _hop(self, plan: Plan, p: int, sent: float) -> float:
        """One micro-batch's send across the boundary after stage p: every rank sends its
        counterpart at once, so the slowest pair's wire time (pipeline_time.hop_time)."""
        g, dp = plan.group, plan.dp
        return hop_time(self.link, sent, [((p * dp + d) * g + j, ((p + 1) * dp + d) * g + j)
                                          for d in range(dp) for j in range(g)])

    def _rank_step(self, plan: Plan, p: int, r: int, rows: float, path: float, sent: float, out) -> float:
        """Rank r's once-per-step work (data-parallel traffic, the tied weight's sum between the
        pipeline's ends, the optimizer step, gradient accumulation) in seconds; fills in its
        memory, bytes, compute and communication."""
        j, m, last = r % plan.group, plan.microbatches, p == plan.pp - 1
        n, t = self.params_of(plan, j, p=p), self.trainable_of(plan, j, p)
        dp_time, dp_bytes = self._dp(plan, n, t, p)
        tied = self.outside_counts(True)["tied"]
        if plan.pp > 1 and tied and (p == 0 or last):
            b = ring_bytes("all_reduce", tied, FP32, 2)
            dp_time, dp_bytes = dp_time + link_time(self.link, "all_reduce", 2, b, 1), dp_bytes + b
        stepped = t / plan.dp if plan.dp_sharding != "none" and plan.dp > 1 else t
        opt = self.devices[r].get("optimizer_s_per_param", {}).get(self.optimizer, 0.0) * stepped
        # a table whose rows go into .grad in place adds none of its gradient: its .grad is zeroed
        # once instead (table_backward)
        added, zero = stepped, 0.0
        if p == 0 and self.rows_accumulate_in_place(plan):
            added, zero = max(stepped - self.table, 0.0), self.table_backward(plan, r, rows)[0]
        acc = (m - 1) * added * self.devices[r].get("grad_accumulate_s_per_param", 0.0) + zero
        out.memory[r] = self.memory_bytes(plan, j, r, n, t, rows, p) / MIB
        out.sent[r] = sent + dp_bytes
        out.compute[r] = m * sum(out.own[r]) + opt + acc
        out.comm[r] = path + dp_time
        return dp_time + opt + acc

    def _replica(self, plan: Plan, p: int, ranks: list[int], rows: float, out) -> tuple[float, float]:
        """One micro-batch of stage p on one replica's group: (forward, backward) at the slowest
        rank of every sub-block, recomputed layers' second forward included; adds each rank's own
        [forward, backward] to out.own[r] and its seconds a step per sub-block to out.sub_s[r]."""
        m = plan.microbatches
        fwd = bwd = 0.0
        kinds = [self.kinds(plan, j) for j in range(len(ranks))]
        if p == 0 and self.table_trains:          # the table's backward: its per-micro-batch part
            parts = [self.table_backward(plan, r, rows) for r in ranks]
            for (once, each), r in zip(parts, ranks):
                out.own[r][1] += each
                out.sub_s[r]["EMB"] = m * each + once
            bwd += max(each for _, each in parts)
        for stack, (layers, c_stack) in self.stage_stacks(plan, p).items():
            for sub in self.subs(stack) if layers else ():
                runs = [("side", k[stack]["con"][1]) if sub == "side" else k[stack][sub] for k in kinds]
                times = [self.flops_time(r, stack, *runs[j], rows) for j, r in enumerate(ranks)]
                for (tf, tb), r in zip(times, ranks):
                    out.own[r][0] += layers * tf
                    out.own[r][1] += layers * tb + c_stack * tf
                    label = sub.upper()
                    out.sub_s[r][label] = out.sub_s[r].get(label, 0.0) + m * (layers * (tf + tb) + c_stack * tf)
                f_max, b_max = max(t[0] for t in times), max(t[1] for t in times)
                fwd += layers * f_max
                bwd += layers * b_max + c_stack * f_max
        if p < plan.pp - 1:
            return fwd, bwd
        times = [self._ends_time(r, plan, j, rows) for j, r in enumerate(ranks)]
        for (tf, tb), r in zip(times, ranks):
            out.own[r][0] += tf
            out.own[r][1] += tb
            out.sub_s[r]["HEAD"] = m * (tf + tb)
        return fwd + max(t[0] for t in times), bwd + max(t[1] for t in times)


class _Out:
    """What an estimate gathers per global rank."""

    def __init__(self, world: int):
        self.memory, self.sent, self.compute, self.comm = ([0.0] * world for _ in range(4))
        self.own = [[0.0, 0.0] for _ in range(world)]
        self.sub_s = [{} for _ in range(world)]


def _hf_config(raw: dict):
    """The family's config class from config.json's keys (what the closed forms read)."""
    from transformers import AutoConfig
    keys = {k: v for k, v in raw.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(raw["model_type"], **keys)
    except (ValueError, KeyError):
        return SimpleNamespace(**raw)
