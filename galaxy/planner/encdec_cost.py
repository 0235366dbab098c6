"""The cost model of an encoder-decoder plan (BART, T5): step time and peak memory per rank, from
a version-2 model profile (galaxy.planner.encdec_profile) and the devices profile, for full
fine-tuning or a PEFT method (the profile's "peft" section, galaxy.planner.encdec_method).

What it covers so far: one pipeline stage (pp 1) holding both stacks, any data-parallel degree,
plain or sharded (dp_sharding). The plan's encoder layers run at the source shares (tokens) and
the decoder's at the target shares (decoder_tokens), XATT by its own method (xatt):

  time     per micro-batch, each sub-block at its slowest rank (FLOPs at the rank's share over its
           device's GEMM rate: the devices' compute tables hold no decoder kinds yet), the
           encoder's L_e x (ATT, CON, MLP, CON) and the decoder's L_d x (ATT, CON, XATT, CON, MLP,
           CON), the embeddings and the head; plus the group's collectives of the family's closed
           form (galaxy.models.encdec_forms, bytes per kind, split into per-row and once-per-step
           parts), timed on the link; then the data-parallel traffic, the optimizer step and, with
           m micro-batches, m - 1 additions into .grad.
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
import math
from types import SimpleNamespace

from galaxy.distributed.comm_bytes import ring_bytes
from galaxy.models.registry import family_of
from galaxy.plan import Plan
from galaxy.planner.cost import DDP_BUCKET_BYTES, Estimate
from galaxy.planner.encdec_terms import STACKS, EncDecTerms
from galaxy.planner.model_terms import FP32, MIB
from galaxy.planner.link_model import link_time

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
    def comm_forms(self, plan: Plan) -> dict:
        """kind -> (wire bytes per row of a micro-batch, once per step, calls per micro-batch) of
        the group's collectives: the family's closed form at 1 and 2 rows, under a method its
        per-row part as the backbone runs (forward only: half; side-only: none) and the side
        layers' K/V gathers, its once-a-step part the trained "sum" gradients' all-reduce."""
        if plan.group == 1:
            return {}
        at = {b: self.family.plan_comm_bytes(plan, self._hf, b, list(plan.tokens), num_labels=self.num_labels)
              for b in (1, 2)}
        runs = 1.0 if self.backward_through_backbone else 0.5 if self.backbone == "forward" else 0.0
        out = {}
        for kind in set(at[1]) | set(at[2]):
            s1, s2 = (at[b].get(kind, {"sent": 0, "calls": 0}) for b in (1, 2))
            per_row = s2["sent"] - s1["sent"]
            step = s1["sent"] - per_row if self.trains_backbone else 0
            out[kind] = (runs * per_row, step, round(runs * s1["calls"]))
        if not self.trains_backbone:
            summed = self.enc_layers * self.summed_layer_params("encoder", self.kinds(plan, 0)["encoder"], plan) + \
                self.dec_layers * self.summed_layer_params("decoder", self.kinds(plan, 0)["decoder"], plan) + \
                self.summed_outside(plan)
            a, s, c = out.get("all_reduce", (0.0, 0, 0))
            out["all_reduce"] = (a, s + (ring_bytes("all_reduce", int(summed), FP32, plan.group) if summed else 0), c)
        if self.side_width and plan.con == "SP":       # each side layer's K and V: [rows, t_r, 2w], padded
            kv = sum(layers * ring_bytes("all_gather", max(shares) * 2 * self.side_width, FP32, plan.group)
                     for layers, shares in ((self.enc_layers, plan.tokens), (self.dec_layers, plan.decoder_tokens)))
            for kind in ("all_gather", "reduce_scatter"):
                a, s, c = out.get(kind, (0.0, 0, 0))
                out[kind] = (a + kv, s, c + self.layers)
        return out

    def _dp(self, plan: Plan, n: float, t: float) -> tuple[float, float]:
        """Seconds and bytes of a rank's data-parallel traffic a step (n held, t trained): DDP
        all-reduces the trained gradients; FSDP gathers every weight and reduce-scatters them."""
        dp = plan.dp
        if dp <= 1:
            return 0.0, 0.0
        if plan.dp_sharding == "none":
            if not t:
                return 0.0, 0.0
            b = ring_bytes("all_reduce", int(t), FP32, dp)
            return link_time(self.link, "all_reduce", dp, b, max(1, math.ceil(t * FP32 / DDP_BUCKET_BYTES))), b
        passes = 2 if self.backward_through_backbone else 1
        gathers = passes * plan.microbatches if plan.dp_sharding == "full" else 1
        ag = ring_bytes("all_gather", math.ceil(n / dp), FP32, dp)
        rs = ring_bytes("reduce_scatter", math.ceil(t / dp), FP32, dp)
        time = link_time(self.link, "all_gather", dp, gathers * ag, gathers * self.layers) + \
            link_time(self.link, "reduce_scatter", dp, rs, self.layers)
        return time, gathers * ag + rs

    # --- the step --------------------------------------------------------------------------------------

    def estimate(self, plan: Plan) -> Estimate:
        if plan.pp != 1:
            raise ValueError("the encoder-decoder cost model covers pp 1")
        g, m = plan.group, plan.microbatches
        rows = self.batch / (plan.dp * m)
        padded = len(set(plan.tokens)) > 1 or len(set(plan.decoder_tokens)) > 1
        forms = self.comm_forms(plan)
        comm_mb = sum(link_time(self.link, kind, g, rows * a, calls, padded) for kind, (a, _, calls) in forms.items())
        comm_step = sum(link_time(self.link, kind, g, s, 0) for kind, (_, s, _) in forms.items() if s)
        sent_group = sum(m * rows * a + s for a, s, _ in forms.values())
        fwd = bwd = 0.0
        memory, sent, compute, comm_rank = [], [], [], []
        own, subs_s = [[0.0, 0.0] for _ in range(self.world)], [{} for _ in range(self.world)]
        for d in range(plan.dp):
            f, b = self._replica(plan, [d * g + j for j in range(g)], rows, own, subs_s)
            fwd, bwd = max(fwd, f), max(bwd, b)
        extra = 0.0
        for r in range(self.world):
            j = r % g
            n, t = self.params_of(plan, j), self.trainable_of(plan, j)
            dp_time, dp_bytes = self._dp(plan, n, t)
            stepped = t / plan.dp if plan.dp_sharding != "none" and plan.dp > 1 else t
            opt = self.devices[r].get("optimizer_s_per_param", {}).get(self.optimizer, 0.0) * stepped
            acc = (m - 1) * stepped * self.devices[r].get("grad_accumulate_s_per_param", 0.0)
            extra = max(extra, dp_time + opt + acc)
            memory.append(self.memory_bytes(plan, j, r, n, t, rows) / MIB)
            sent.append(int(sent_group + dp_bytes))
            compute.append(m * sum(own[r]) + opt + acc)
            comm_rank.append(m * comm_mb + comm_step + dp_time)
        step = m * (fwd + bwd + comm_mb) + comm_step + extra
        return Estimate(plan, step, memory, sent, compute, m * comm_mb + comm_step, comm_rank, subs_s)

    def _replica(self, plan: Plan, ranks: list[int], rows: float, own: list, sub_s: list) -> tuple[float, float]:
        """One micro-batch on one replica's group: (forward, backward) at the slowest rank of every
        sub-block, recomputed layers' second forward included; adds each rank's own [forward,
        backward] to own[r] and its seconds a step per sub-block to sub_s[r]."""
        m, c = plan.microbatches, len(plan.checkpoint)
        fwd = bwd = 0.0
        kinds = [self.kinds(plan, j) for j in range(len(ranks))]
        for stack, layers, c_stack in (("encoder", self.enc_layers, min(c, self.enc_layers)),
                                       ("decoder", self.dec_layers, max(0, c - self.enc_layers))):
            for sub in self.subs(stack):
                at = lambda j: ("side", kinds[j][stack]["con"][1]) if sub == "side" else kinds[j][stack][sub]  # noqa: E731
                times = [self.flops_time(r, stack, *at(j), rows) for j, r in enumerate(ranks)]
                for (tf, tb), r in zip(times, ranks):
                    own[r][0] += layers * tf
                    own[r][1] += layers * tb + c_stack * tf
                    label = sub.upper()
                    sub_s[r][label] = sub_s[r].get(label, 0.0) + m * (layers * (tf + tb) + c_stack * tf)
                f_max, b_max = max(t[0] for t in times), max(t[1] for t in times)
                fwd += layers * f_max
                bwd += layers * b_max + c_stack * f_max
        times = [self._ends_time(r, plan, j, rows) for j, r in enumerate(ranks)]
        for (tf, tb), r in zip(times, ranks):
            own[r][0] += tf
            own[r][1] += tb
            sub_s[r]["HEAD"] = m * (tf + tb)
        return fwd + max(t[0] for t in times), bwd + max(t[1] for t in times)


def _hf_config(raw: dict):
    """The family's config class from config.json's keys (what the closed forms read)."""
    from transformers import AutoConfig
    keys = {k: v for k, v in raw.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(raw["model_type"], **keys)
    except (ValueError, KeyError):
        return SimpleNamespace(**raw)
