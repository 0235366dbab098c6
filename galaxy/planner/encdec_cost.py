"""The cost model of an encoder-decoder plan (BART, T5): step time and peak memory per rank, from
a version-2 model profile (galaxy.planner.encdec_profile) and the devices profile.

What it covers so far: one pipeline stage (pp 1) holding both stacks, any data-parallel degree
without sharding, full fine-tuning. The plan's encoder layers run at the source shares (tokens)
and the decoder's at the target shares (decoder_tokens), XATT by its own method (xatt):

  time     per micro-batch, each sub-block at its slowest rank (FLOPs at the rank's share over its
           device's GEMM rate: the devices' compute tables hold no decoder kinds yet), the
           encoder's L_e x (ATT, CON, MLP, CON) and the decoder's L_d x (ATT, CON, XATT, CON, MLP,
           CON), the embeddings and the head; plus the group's collectives of the family's closed
           form (galaxy.models.encdec_forms, bytes per kind, split into per-row and once-per-step
           parts), timed on the link; then DDP's all-reduce over the replicas, the optimizer step
           and, with m micro-batches, m - 1 additions into .grad.
  memory   as galaxy.planner.memory_model counts a stage: the baseline, weights, gradients,
           optimizer state, DDP's and the group's gradient buckets, the activations of one
           micro-batch at the rank's shares (a recomputed layer keeping only its input carry,
           leading layers first: the encoder's) with the CPU heap's slack, and an unfused step's
           temporaries.

XATT under SP projects the whole memory's K/V on every rank (S source tokens): its FLOPs are the
memory's part (`fwd_memory`) plus the rest at the rank's share of target tokens.
"""
from __future__ import annotations

import functools
from types import SimpleNamespace

from galaxy.distributed.comm_bytes import ring_bytes
from galaxy.models.registry import family_of
from galaxy.plan import Plan
from galaxy.planner.cost import DDP_BUCKET_BYTES, Estimate
from galaxy.planner.memory_model import CPU_ACTIVATION_SLACK, OPT_STATE, OPT_TEMP
from galaxy.planner.model_terms import FP32, MIB
from galaxy.planner.link_model import link_time

ENCODER_SUBS = ("att", "con", "mlp", "con")
DECODER_SUBS = ("att", "con", "xatt", "con", "mlp", "con")


class EncDecCostModel:
    def __init__(self, model: dict, devices: list[dict], link: dict | None, *, batch_size: int,
                 optimizer: str = "adamw"):
        self.model, self.devices, self.link = model, devices, link
        self.batch, self.optimizer, self.world = batch_size, optimizer, len(devices)
        self.stacks = model["stacks"]
        self.enc_layers, self.dec_layers = self.stacks["encoder"]["layers"], self.stacks["decoder"]["layers"]
        self.layers = self.enc_layers + self.dec_layers
        self.source, self.target = model["pad_size"], model["target_pad_size"]
        self.hidden = model["hf_config"].get("d_model") or model["hf_config"]["hidden_size"]
        self.carry = model["carry_tensors"]
        self.family = family_of(model["model_type"])
        self.num_labels = model.get("num_labels") if model["task"] == "classification" else None
        self.backward_through_backbone = True
        self._hf = _hf_config(model["hf_config"])

    # --- what a Galaxy rank runs -----------------------------------------------------------------

    def kinds(self, plan: Plan, j: int) -> dict:
        """stack -> {sub-block: (kind, units)} of Galaxy rank j, and each stack's CON tokens."""
        g = plan.group
        out = {}
        for stack, tokens, whole in (("encoder", plan.tokens, self.source), ("decoder", plan.decoder_tokens, self.target)):
            share = tokens[j] if g > 1 else whole
            pick = {"att": plan.att, "mlp": plan.mlp, **({"xatt": plan.method("xatt")} if stack == "decoder" else {})}
            subs = {sub: (f"{sub}_tp", plan.heads[j] if sub != "mlp" else plan.columns[j])
                    if method == "TP" or g == 1 else (f"{sub}_sp", share) for sub, method in pick.items()}
            subs["con"] = ("con", share if plan.con == "SP" and g > 1 else whole)
            out[stack] = subs
        return out

    def flops_time(self, r: int, stack: str, kind: str, units: int, rows: float) -> tuple[float, float]:
        """(forward, backward) seconds of one sub-block kind of a stack on device r."""
        rate = self.devices[r].get("gemm_flops_per_s")
        if not rate:
            return 0.0, 0.0
        section = self.stacks[stack]
        f = section["flops_per_row"][kind.split("_")[0]]
        total = section["units"][kind][0]
        fixed = f.get("fwd_memory", 0) if kind == "xatt_sp" else 0     # the whole memory's K/V, every rank
        fwd = fixed + (f["fwd"] - fixed) * units / total
        bwd = fwd * f["bwd"] / f["fwd"] if f["fwd"] else 0.0        # the closed forms: twice the forward
        return fwd / rate * rows, bwd / rate * rows

    def _ends_time(self, r: int, plan: Plan, j: int, rows: float) -> tuple[float, float]:
        """The head on the rank's target tokens (the classifier: on each row's pooled token)."""
        rate = self.devices[r].get("gemm_flops_per_s")
        f = self.model["flops_per_row"]["head"]
        share = plan.decoder_tokens[j] / self.target if plan.con == "SP" and plan.group > 1 else 1.0
        share = 1.0 if self.num_labels is not None else share
        return (f["fwd"] / rate * rows * share, f["bwd"] / rate * rows * share) if rate else (0.0, 0.0)

    # --- parameters --------------------------------------------------------------------------------

    @staticmethod
    def _count(v, units) -> float:
        return v[0] + v[1] * units if isinstance(v, list) else v

    def layer_params(self, stack: str, subs: dict) -> float:
        p = self.stacks[stack]["params"]
        return sum(self._count(p[kind], units) for sub, (kind, units) in subs.items() if sub != "con") + p["con"]

    def summed_layer_params(self, stack: str, subs: dict, plan: Plan) -> float:
        """A layer's parameters whose gradients the group sums: SP sub-blocks' and, under CON SP, the CONs'."""
        if plan.group == 1:
            return 0.0
        p = self.stacks[stack]["params"]
        out = sum(p[kind] for sub, (kind, _) in subs.items() if kind.endswith("_sp"))
        return out + (p["con"] if plan.con == "SP" else 0)

    def params_of(self, plan: Plan, j: int) -> float:
        k = self.kinds(plan, j)
        whole = self.model["params"]
        outside = whole["embed"] + whole["head"] - whole["tied"] + whole.get("other", 0)
        if plan.att == "TP" and plan.group > 1:       # T5's position bias: the rank's heads' columns
            outside -= whole.get("by_heads", 0) * (1 - plan.heads[j] / self.stacks["encoder"]["units"]["att_tp"][0])
        return outside + self.enc_layers * self.layer_params("encoder", k["encoder"]) + \
            self.dec_layers * self.layer_params("decoder", k["decoder"])

    # --- activations -------------------------------------------------------------------------------

    def _act(self, acts: dict, kind: str, units: float) -> float:
        c0, c1 = acts[kind]
        return c0 + c1 * units

    def layer_acts(self, stack: str, subs: dict) -> tuple[float, float]:
        """(bytes one layer of `stack` saves per row, its largest sub-block's)."""
        acts = self.stacks[stack]["act_bytes_per_row"]
        parts = [self._act(acts, kind, units) for sub, (kind, units) in subs.items() if sub != "con"]
        con = self._act(acts, "con", subs["con"][1])
        parts += [con] * self.stacks[stack].get("cons", 2)
        return sum(parts), max(parts)

    def acts_per_row(self, plan: Plan, j: int) -> tuple[float, float, float]:
        """(every layer's saved bytes per row with the leading recomputed ones keeping their
        carry, the largest sub-block's, one recomputed layer's), embeddings and head included."""
        k, c = self.kinds(plan, j), len(plan.checkpoint)
        enc, enc_big = self.layer_acts("encoder", k["encoder"])
        dec, dec_big = self.layer_acts("decoder", k["decoder"])
        carry = {s: self.carry * k[s]["con"][1] * self.hidden * FP32 for s in ("encoder", "decoder")}
        c_enc, c_dec = min(c, self.enc_layers), max(0, c - self.enc_layers)
        total = (self.enc_layers - c_enc) * enc + c_enc * carry["encoder"] + \
            (self.dec_layers - c_dec) * dec + c_dec * carry["decoder"]
        ends = self.model["act_bytes_per_row"]
        total += self._act(ends, "embed", self.source) + self._act(ends, "head", k["decoder"]["con"][1])
        return total, max(enc_big, dec_big), (max(enc, dec) if c else 0.0)

    def memory_bytes(self, plan: Plan, j: int, r: int, n: float, rows: float) -> float:
        dev, dp = self.devices[r], plan.dp
        k = self.kinds(plan, j)
        summed = sum(layers * self.summed_layer_params(stack, k[stack], plan)
                     for stack, layers in (("encoder", self.enc_layers), ("decoder", self.dec_layers)))
        state = FP32 * (2 * n + OPT_STATE.get(self.optimizer, 0) * n + (n if dp > 1 else 0) + summed)
        total, biggest, recomputed = self.acts_per_row(plan, j)
        acts = rows * (total + recomputed + biggest)
        temp = 0.0 if dev.get("optimizer_fused") else OPT_TEMP.get(self.optimizer, 0) * n * FP32
        base = dev.get("baseline_mib", 0.0) * MIB + state
        if dev.get("device", "cpu") == "cuda":
            return base + max(acts, temp)
        whole = rows * (self.acts_per_row(_without_checkpoint(plan), j)[0] + biggest) if plan.checkpoint else acts
        return base + acts + dev.get("activation_slack", CPU_ACTIVATION_SLACK) * whole + temp

    def estimate_memory(self, plan: Plan) -> list[float]:
        rows = self.batch / (plan.dp * plan.microbatches)
        return [self.memory_bytes(plan, r % plan.group, r, self.params_of(plan, r % plan.group), rows) / MIB
                for r in range(self.world)]

    def stage_ranks(self, plan: Plan, p: int) -> list[int]:
        return list(range(self.world))

    # --- time ----------------------------------------------------------------------------------------

    @functools.lru_cache(maxsize=4096)
    def comm_forms(self, plan: Plan) -> dict:
        """kind -> (wire bytes per row of a micro-batch, once per step, calls per micro-batch) of
        the group's collectives: the family's closed form at 1 and 2 rows."""
        if plan.group == 1:
            return {}
        at = {b: self.family.plan_comm_bytes(plan, self._hf, b, list(plan.tokens), num_labels=self.num_labels)
              for b in (1, 2)}
        out = {}
        for kind in set(at[1]) | set(at[2]):
            s1, s2 = (at[b].get(kind, {"sent": 0, "calls": 0}) for b in (1, 2))
            per_row = s2["sent"] - s1["sent"]
            out[kind] = (per_row, s1["sent"] - per_row, s1["calls"])
        return out

    def estimate(self, plan: Plan) -> Estimate:
        if plan.pp != 1 or plan.dp_sharding != "none":
            raise ValueError("the encoder-decoder cost model covers pp 1 without dp_sharding")
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
            n = self.params_of(plan, j)
            dp_time, dp_bytes = self._dp(plan, n)
            opt = self.devices[r].get("optimizer_s_per_param", {}).get(self.optimizer, 0.0) * n
            acc = (m - 1) * n * self.devices[r].get("grad_accumulate_s_per_param", 0.0)
            extra = max(extra, dp_time + opt + acc)
            memory.append(self.memory_bytes(plan, j, r, n, rows) / MIB)
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
        for stack, layers, subs, c_stack in (("encoder", self.enc_layers, ENCODER_SUBS, min(c, self.enc_layers)),
                                             ("decoder", self.dec_layers, DECODER_SUBS, max(0, c - self.enc_layers))):
            for sub in subs:
                times = [self.flops_time(r, stack, *kinds[j][stack][sub], rows) for j, r in enumerate(ranks)]
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

    def _dp(self, plan: Plan, n: float) -> tuple[float, float]:
        if plan.dp <= 1:
            return 0.0, 0.0
        b = ring_bytes("all_reduce", int(n), FP32, plan.dp)
        calls = max(1, -(-int(n * FP32) // DDP_BUCKET_BYTES))
        return link_time(self.link, "all_reduce", plan.dp, b, calls), b


def _without_checkpoint(plan: Plan) -> Plan:
    from dataclasses import replace
    return replace(plan, checkpoint=())


def _hf_config(raw: dict):
    """The family's config class from config.json's keys (what the closed forms read)."""
    from transformers import AutoConfig
    keys = {k: v for k, v in raw.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(raw["model_type"], **keys)
    except (ValueError, KeyError):
        return SimpleNamespace(**raw)
