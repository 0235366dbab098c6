"""What one rank of an encoder-decoder plan holds and keeps (BART, T5): its sub-blocks' kinds and
shares in each stack, its parameters (held, and trained under the run's fine-tuning method), the
activations it saves, and its peak memory. galaxy.planner.encdec_cost times it.

The figures are the version-2 model profile's (galaxy.planner.encdec_profile), or, under a PEFT
method, its "peft" section's (galaxy.planner.encdec_method), read as galaxy.planner.model_terms
and memory_model read a version-1 profile and its section:

  parameters   every weight is held (FSDP shards frozen ones too); gradients, optimizer state and
               its temporaries, DDP's and the Galaxy group's buckets cover the trained ones only
  activations  what the method saves; a backbone run without autograd (side-tuning) saves none but
               makes its largest sub-block's intermediates while it runs; the side layers save theirs
  memory       galaxy.planner.memory_model's sum: the baseline, weights (dp_sharding: a 1/dp shard,
               plus two gathered layers under "full", or every weight again under "no_reshard"),
               gradients and optimizer state (sharded alike), the buckets, the activations of the
               micro-batches in flight with the CPU heap's slack, and an unfused step's temporaries
  stages       a pipeline stage holds a run of the layer list (the encoder's layers, then the
               decoder's: a stage may hold both), the embeddings on the first stage, the head on
               the last (both ends hold a tied weight), what lies beside the layers on every stage
  vocabulary   the shared [vocab, d_model] table's gradient (galaxy.parallel.embedding_grad): where
               its rows accumulate in place (rows_accumulate_in_place: BART / T5's `shared` on a
               pipeline's first stage, untied T5 v1.1 at pp 1, m > 1) a step makes no fresh dense
               gradient of it; where the lookup stays dense (a head tied on the same stage, FSDP's
               replicas) a heap that keeps freed memory keeps memory_model's kept_gradient_blocks
"""
from __future__ import annotations

import functools
from dataclasses import replace

from galaxy.plan import Plan
from galaxy.planner.memory_model import (CPU_ACTIVATION_SLACK, OPT_STATE, OPT_TEMP, MemoryModel,
                                         embedding_rows_in_place)
from galaxy.planner.method import BACKBONE, BackboneRole
from galaxy.planner.model_terms import FP32, MIB, ModelTerms, boundary_ends

STACKS = ("encoder", "decoder")


def count(v, units) -> float:
    """A profile's count: [c0, c1] at `units` (c0 + c1 x units), or a whole count."""
    return v[0] + v[1] * units if isinstance(v, list) else v


class EncDecTerms(BackboneRole):
    def __init__(self, model: dict, devices: list[dict], link: dict | None, *, batch_size: int,
                 optimizer: str = "adamw", method: dict | None = None):
        """method: the signature (galaxy.planner.method) of the fine-tuning method to cost; the
        profile's "peft" section must be of it. None: full fine-tuning."""
        self.model, self.devices, self.link = model, devices, link
        self.batch, self.optimizer, self.world = batch_size, optimizer, len(devices)
        self.stacks = model["stacks"]
        self.enc_layers, self.dec_layers = self.stacks["encoder"]["layers"], self.stacks["decoder"]["layers"]
        self.layers = self.enc_layers + self.dec_layers
        self.source, self.target = model["pad_size"], model["target_pad_size"]
        self.hidden = model["hf_config"].get("d_model") or model["hf_config"]["hidden_size"]
        self.carry = model["carry_tensors"]
        self.method = method or {"method": "full"}
        self.backbone = BACKBONE[self.method["method"]]
        self.section = model.get("peft") if self.backbone != "trained" else None
        if self.backbone != "trained" and (self.section is None or self.section["signature"] != self.method):
            raise ValueError("the model profile's peft section is not of the method to cost")
        self.side_width = self.section["side_width"] if self.section else 0
        # the vocabulary table (BART / T5's `shared`), of the first stage's "embed" parameters
        self.table = model["hf_config"]["vocab_size"] * self.hidden
        self.table_trains = self.trains_backbone and self.outside_counts(True)["embed"] > 0

    def rows_accumulate_in_place(self, plan: Plan) -> bool:
        """Whether stage 0's shared table adds each micro-batch's rows into its .grad in place
        (memory_model.embedding_rows_in_place: the tied head sits on the same stage at pp 1 only)."""
        return embedding_rows_in_place(plan, self.table_trains, self.outside_counts(True)["tied"] > 0)

    # --- what a Galaxy rank runs -----------------------------------------------------------------

    def kinds(self, plan: Plan, j: int) -> dict:
        """stack -> {sub-block: (kind, units)} of Galaxy rank j ("con": the stack's CON tokens)."""
        g = plan.group
        out = {}
        for stack, tokens, whole in (("encoder", plan.tokens, self.source),
                                     ("decoder", plan.decoder_tokens, self.target)):
            share = tokens[j] if g > 1 else whole
            pick = {"att": plan.att, "mlp": plan.mlp, **({"xatt": plan.method("xatt")} if stack == "decoder" else {})}
            subs = {sub: (f"{sub}_tp", plan.heads[j] if sub != "mlp" else plan.columns[j])
                    if method == "TP" or g == 1 else (f"{sub}_sp", share) for sub, method in pick.items()}
            subs["con"] = ("con", share if plan.con == "SP" and g > 1 else whole)
            out[stack] = subs
        return out

    @functools.lru_cache(maxsize=65536)       # the search asks for the same stages many times
    def stage_stacks(self, plan: Plan, p: int) -> dict:
        """stack -> (its layers on stage p, how many of them recompute)."""
        ckpt = set(plan.checkpoint if isinstance(plan.checkpoint, tuple) else plan.recomputed)
        layers = plan.stage_layers()[p]
        enc = [i for i in layers if i < self.enc_layers]
        dec = [i for i in layers if i >= self.enc_layers]
        return {"encoder": (len(enc), sum(i in ckpt for i in enc)), "decoder": (len(dec), sum(i in ckpt for i in dec))}

    @staticmethod
    def stage_of(plan: Plan, r: int) -> tuple[int, int]:
        """(stage, Galaxy rank) of global rank r: ranks run (stage, replica, Galaxy rank)."""
        return r // (plan.dp * plan.group), r % plan.group

    @staticmethod
    def stage_ranks(plan: Plan, p: int) -> list[int]:
        return [(p * plan.dp + d) * plan.group + j for d in range(plan.dp) for j in range(plan.group)]

    # --- parameters --------------------------------------------------------------------------------

    def stack_counts(self, stack: str, trained: bool = False) -> dict:
        """kind -> count of one layer of `stack` (held, or those that train)."""
        if self.section is None:
            return self.stacks[stack]["params"]
        return self.section["stacks"][stack]["trainable" if trained else "params"]

    def outside_counts(self, trained: bool = False) -> dict:
        if self.section is None:
            return self.model["params"]
        return self.section["trainable" if trained else "params"]

    def layer_params(self, stack: str, subs: dict, trained: bool = False) -> float:
        p = self.stack_counts(stack, trained)
        return sum(count(p[kind], units) for sub, (kind, units) in subs.items() if sub != "con") + \
            p["con"] + p.get("side", 0)

    def summed_layer_params(self, stack: str, subs: dict, plan: Plan) -> float:
        """A layer's trained parameters whose gradients the group sums: the SP sub-blocks', under
        a method the whole part of a TP sub-block's (LoRA's A or B that no head slices), and
        under CON SP the CONs' (and the side layer's)."""
        if plan.group == 1:
            return 0.0
        t = self.stack_counts(stack, trained=True)
        out = 0.0
        for sub, (kind, units) in subs.items():
            if kind.endswith("_sp"):
                out += count(t[kind], units)
            elif kind.endswith("_tp") and not self.trains_backbone and isinstance(t[kind], list):
                out += t[kind][0]
        return out + (t["con"] + t.get("side", 0) if plan.con == "SP" else 0)

    def summed_outside(self, plan: Plan, p: int = 0) -> float:
        """Trained parameters outside the layers stage p's group sums (a method's, under CON SP);
        full fine-tuning's are in the closed forms' once-a-step bytes."""
        if self.section is None or plan.group == 1 or plan.con != "SP":
            return 0.0
        s = self.section["summed_outside"]
        return s.get("other", 0) + (s.get("embed", 0) if p == 0 else 0) + (s.get("head", 0) if p == plan.pp - 1 else 0)

    def summed_of(self, plan: Plan, p: int, j: int = 0) -> float:
        """Trained parameters whose gradients stage p's group sums (galaxy.parallel.grad_sync)."""
        k, stacks = self.kinds(plan, j), self.stage_stacks(plan, p)
        return sum(stacks[s][0] * self.summed_layer_params(s, k[s], plan) for s in STACKS) + \
            self.summed_outside(plan, p)

    def params_of(self, plan: Plan, j: int, trained: bool = False, p: int = 0) -> float:
        """Parameters Galaxy rank j of stage p holds (trained: those that train)."""
        if trained and self.section is None:
            trained = False                       # full fine-tuning trains what it holds
        k = self.kinds(plan, j)
        whole = self.outside_counts(trained)
        outside = whole.get("other", 0) + (whole["embed"] if p == 0 else 0) + \
            (whole["head"] if p == plan.pp - 1 else 0) - (whole["tied"] if plan.pp == 1 else 0)
        if plan.att == "TP" and plan.group > 1 and not trained:   # T5's position bias: the rank's heads'
            by_heads = self.model["params"].get("by_heads", 0)
            outside -= by_heads * (1 - plan.heads[j] / self.stacks["encoder"]["units"]["att_tp"][0])
        stacks = self.stage_stacks(plan, p)
        return outside + sum(stacks[s][0] * self.layer_params(s, k[s], trained) for s in STACKS)

    def trainable_of(self, plan: Plan, j: int, p: int = 0) -> float:
        return self.params_of(plan, j, trained=True, p=p)

    # --- activations -------------------------------------------------------------------------------

    def _acts(self, stack: str, full: bool = False) -> dict:
        if self.section is None or full:
            return self.stacks[stack]["act_bytes_per_row"]
        return self.section["stacks"][stack]["act_bytes_per_row"]

    def layer_acts(self, stack: str, subs: dict, full: bool = False) -> tuple[float, float]:
        """(bytes one layer of `stack` saves per row, its largest sub-block's); a backbone run
        without autograd: its side layer's. full: as full fine-tuning saves them."""
        acts = self._acts(stack, full)
        if not self.backward_through_backbone:
            side = count(acts["side"], subs["con"][1])
            return side, side
        parts = [count(acts[kind], units) for sub, (kind, units) in subs.items() if sub != "con"]
        parts += [count(acts["con"], subs["con"][1])] * self.stacks[stack].get("cons", 2)
        return sum(parts), max(parts)

    def forward_working(self, stack: str, subs: dict) -> float:
        """Bytes per row a backbone sub-block run without autograd makes while it runs: the
        largest one's activations (side-tuning; side-only runs no backbone layer)."""
        if self.backbone != "forward":
            return 0.0
        acts = self._acts(stack, full=True)
        return max(count(acts[kind], units) for kind, units in subs.values())

    def acts_per_row(self, plan: Plan, j: int, full: bool = False, p: int = 0) -> tuple[float, float, float]:
        """(stage p's layers' saved bytes per row with the recomputed ones keeping their input
        carry, the largest sub-block's (or working space), one recomputed layer's), the
        embeddings on the first stage and the head on the last included."""
        k, stacks = self.kinds(plan, j), self.stage_stacks(plan, p)
        total = biggest = rebuilt = 0.0
        for s in STACKS:
            layers, c = stacks[s]
            if not layers:
                continue
            layer, big = self.layer_acts(s, k[s], full)
            carry = self.carry * k[s]["con"][1] * self.hidden * FP32
            total += (layers - c) * layer + c * carry
            biggest = max(biggest, big, self.forward_working(s, k[s]))
            rebuilt = max(rebuilt, layer if sum(c for _, c in stacks.values()) else 0.0)
        ends = self.model["act_bytes_per_row"]
        total += (count(ends["embed"], self.source) if p == 0 else 0) + \
            (count(ends["head"], k["decoder"]["con"][1]) if p == plan.pp - 1 else 0)
        return total, biggest, rebuilt

    def boundary_bytes(self, plan: Plan, after: int, rows: float, j: int | None = None) -> tuple[float, float]:
        """(bytes sent forward, bytes of the gradient sent back) at the stage boundary with
        `after` layers before it, one micro-batch (galaxy.pipeline.carry): inside the encoder its
        carry and the decoder's entered embeddings; past it the encoder's output (which crosses
        every decoder boundary) and the decoder's carry; the side states beside them. At Galaxy
        rank j's CON tokens, or (None) the group's largest share, which every rank's send is
        padded to."""
        con_sp = plan.con == "SP" and plan.group > 1
        pick = max if j is None else (lambda tokens: tokens[j])     # noqa: E731
        s_src = pick(plan.tokens) if con_sp else self.source
        s_tgt = pick(plan.decoder_tokens) if con_sp else self.target
        n = self.carry
        backbone = (n * s_src if after < self.enc_layers else s_src) + n * s_tgt
        backbone = 0 if self.backbone == "absent" else backbone * self.hidden
        side = (s_src + s_tgt) * self.side_width
        back = (backbone if self.backward_through_backbone else 0) + side
        return rows * FP32 * (backbone + side), rows * FP32 * back

    def boundary_per_row(self, plan: Plan, p: int, j: int) -> float:
        """Bytes per row of one micro-batch's tensors at stage p's boundaries that rank j keeps
        until its step ends (model_terms.boundary_ends: the carry and its gradient at each end it
        has)."""
        layers = plan.stage_layers()[p]
        return sum(sum(self.boundary_bytes(plan, after, 1.0, j))
                   for held, after in zip(boundary_ends(plan, p), (layers.start, layers.stop)) if held)

    # --- memory --------------------------------------------------------------------------------------

    def state_bytes(self, plan: Plan, j: int, n: float, t: float, p: int = 0) -> tuple[float, float]:
        """(weights, gradients, optimizer state and buckets; the trained parameters a rank steps)
        in bytes and parameters: n held, t trained on stage p (memory_model's terms)."""
        dp = plan.dp
        sharded = plan.dp_sharding != "none" and dp > 1
        weights = n / dp if sharded else n
        k, stacks = self.kinds(plan, j), self.stage_stacks(plan, p)
        if sharded and plan.dp_sharding == "full":     # a layer gathered, the next prefetched
            weights += 2 * max(self.layer_params(s, k[s]) for s in STACKS if stacks[s][0])
        elif sharded:                                  # no_reshard: the gathered weights stay
            weights += n
        held = t / dp if sharded else t
        buckets = (t if dp > 1 else 0) + self.summed_of(plan, p, j) / (dp if sharded else 1)
        return FP32 * (weights + held + OPT_STATE.get(self.optimizer, 0) * held + buckets), held

    def memory_bytes(self, plan: Plan, j: int, r: int, n: float, t: float, rows: float, p: int = 0) -> float:
        """Bytes of rank r (Galaxy rank j of stage p, n parameters held, t trained) at its peak."""
        dev = self.devices[r]
        state, held = self.state_bytes(plan, j, n, t, p)
        total, biggest, recomputed = self.acts_per_row(plan, j, p=p)
        inflight = ModelTerms.in_flight(plan, p)
        # memory_model's boundary tensors of the micro-batches past their backward
        boundary = ModelTerms.past_backward(plan, p) * self.boundary_per_row(plan, p, j)
        acts = rows * (inflight * total + recomputed + biggest + boundary)
        temp = 0.0 if dev.get("optimizer_fused") else OPT_TEMP.get(self.optimizer, 0) * held * FP32
        base = dev.get("baseline_mib", 0.0) * MIB + state
        if dev.get("device", "cpu") == "cuda":
            return base + max(acts, temp)
        # memory_model's slack: over the activations as if none were recomputed, and a frozen
        # backbone's as full fine-tuning saves them (its backward makes every activation's gradient)
        # and memory_model's fragmented heap of a stage with few micro-batches in flight
        frozen, spread = self.backbone == "frozen", inflight + ModelTerms.fragmented(plan, p)
        whole = acts if not (plan.checkpoint or frozen or spread > inflight) else \
            rows * (spread * self.acts_per_row(replace(plan, checkpoint=()), j, frozen, p)[0] + biggest + boundary)
        kept = 0.0
        if dev.get("freed_memory_kept") and p == 0 and self.table_trains and not self.rows_accumulate_in_place(plan):
            kept = MemoryModel.kept_gradient_blocks(plan, p) * self.table * FP32
        return base + acts + dev.get("activation_slack", CPU_ACTIVATION_SLACK) * whole + temp + kept

    def estimate_memory(self, plan: Plan) -> list[float]:
        rows = self.batch / (plan.dp * plan.microbatches)
        out = []
        for r in range(self.world):
            p, j = self.stage_of(plan, r)
            n, t = self.params_of(plan, j, p=p), self.trainable_of(plan, j, p)
            out.append(self.memory_bytes(plan, j, r, n, t, rows, p) / MIB)
        return out
