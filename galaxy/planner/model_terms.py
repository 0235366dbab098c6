"""What one rank of a plan holds and runs, read off the model profile: its sub-blocks' kinds and
shares, its parameters (held, and trained under the run's fine-tuning method), the activations a
layer saves per row. The memory and time models build on it.

Under a PEFT method (galaxy.planner.method) the model profile's "peft" section gives the same
figures for the model galaxy.peft makes (galaxy.planner.method_profile): every parameter held,
the method's own included; those that train; the activations the method saves. Full fine-tuning
reads the profile's own figures, as before methods were costed."""
from __future__ import annotations

import functools

from galaxy.plan import Plan
from galaxy.planner.comm_forms import CommForms
from galaxy.planner.device_compute import DeviceCompute, model_signature, tables_match
from galaxy.planner.method import BACKBONE, BackboneRole

MIB = 2 ** 20
FP32 = 4
# A pipeline stage's heap holds the freed activations of at least this many micro-batches (of its
# m), each at this share of the activation slack (ModelTerms.fragmented).
FRAGMENTED_MICROBATCHES = 6
FRAGMENT_SHARE = 0.4


def boundary_ends(plan: Plan, p: int) -> tuple[bool, bool]:
    """(at its input, at its output): whether stage p keeps, at that boundary, one activation-sized
    and one gradient-sized tensor per micro-batch until its step ends (torch's PipelineStage and
    galaxy.pipeline.overlap_schedule, whose sends are waited for when the step ends). At its input
    (p > 0): the receive buffer (args_recv_info[i], kept across steps) and the gradient sent back;
    at its output (p < pp - 1): the gradient's receive buffer (grad_recv_info[i], kept across
    steps) and the output sent on. After a step the stages held m such buffers at each end
    (loopback: 2.25 MiB at m 12, 6.75 at 36), the sent tensors gone. Measured on loopback
    (all-MiniLM-L6-v2, pp 3, 1f1b, one row of [128, 384] fp32 = 0.19 MiB a micro-batch, m 4 to 36):
    with glibc unmapping freed blocks at once, peak RSS grew 2.2, 4.3 and 2.5 of them a
    micro-batch on stages 0, 1, 2 (least squares over m 4, 12, 24, 36: these 2, 4, 2 and a little
    Python); with the heap keeping freed memory (cpu_allocator keep, as the testbed runs) 3.9,
    5.6 and 4.2, where the memory model's 1 + slack times 2, 4, 2 gives 3.1, 6.2, 3.1. Nothing
    else grew with m: the batch's input chunks and each micro-batch's loss are a few KB."""
    return p > 0, p < plan.pp - 1


class Counts:
    """Parameters per part of the model, as a model profile lists them: "embed" (first stage),
    "head" (last stage), "tied" (held by both ends), "other" (every stage), and per layer, by
    sub-block kind, [c0, c1] (c0 + c1 x the rank's share) or a whole count."""

    def __init__(self, doc: dict):
        self.embed, self.head, self.tied = doc["embed"], doc["head"], doc["tied"]
        self.other = doc.get("other", 0)
        self.total = doc.get("total")
        self.layer = doc["layer"]

    def kind(self, kind: str, units: int) -> float:
        v = self.layer.get(kind, 0)
        return v[0] + v[1] * units if isinstance(v, list) else v

    @functools.lru_cache(maxsize=65536)      # the search asks for the same shares many times
    def per_layer(self, att: tuple, mlp: tuple) -> float:
        """One layer at a rank running att = (kind, units) and mlp = (kind, units)."""
        return self.kind(*att) + self.kind(*mlp) + self.kind("con", 0) + self.kind("side", 0)

    def whole_part(self, kind: str) -> float:
        """The part of a TP kind that no share slices (c0: LoRA's unsharded A or B)."""
        v = self.layer.get(kind, 0)
        return v[0] if isinstance(v, list) else v


class ModelTerms(BackboneRole):
    def __init__(self, model: dict, devices: list[dict], link: dict | None, *, batch_size: int,
                 optimizer: str = "adamw", method: dict | None = None):
        """method: the signature (galaxy.planner.method) of the fine-tuning method to cost; the
        model profile's "peft" section must be of it. None: full fine-tuning."""
        self.model, self.devices, self.link = model, devices, link
        self.batch = batch_size
        self.optimizer = optimizer
        self.world = len(devices)
        self.seq = model["pad_size"]
        self.hidden = model["hf_config"]["hidden_size"]
        self.layers = model["hf_config"]["num_hidden_layers"]
        self.method = method or {"method": "full"}
        self.backbone = BACKBONE[self.method["method"]]
        section = model.get("peft") if self.backbone != "trained" else None
        signature = model_signature(model)
        self.compute = [DeviceCompute(d, model, tables_match(d, signature), section) for d in devices]
        self.comm = CommForms(model)
        self.params = Counts(model["params"] if section is None else section["params"])
        self.trainable = self.params if section is None else Counts(section["trainable"])
        # trainable parameters outside the layers on the CON layout: summed over the group under CON SP
        self.summed_outside = {} if section is None else section["summed_outside"]
        self.embed_params, self.head_params, self.tied = self.params.embed, self.params.head, self.trainable.tied
        self.other_params = self.params.other
        self.layer_params = self.params.layer
        self.acts = model["act_bytes_per_row"] if section is None else section["act_bytes_per_row"]
        self.full_acts = model["act_bytes_per_row"]
        self.carry = model["carry_tensors"]
        self.side_width = section.get("side_width", 0) if section else 0

    def _kinds(self, plan: Plan, j: int):
        """(att kind, units), (mlp kind, units), con tokens of Galaxy rank j."""
        att = ("att_tp", plan.heads[j]) if plan.att == "TP" or plan.group == 1 else ("att_sp", plan.tokens[j])
        mlp = ("mlp_tp", plan.columns[j]) if plan.mlp == "TP" or plan.group == 1 else ("mlp_sp", plan.tokens[j])
        con = plan.tokens[j] if plan.con == "SP" and plan.group > 1 else self.seq
        return att, mlp, con

    def _kind_params(self, kind: str, units: int) -> float:
        """Parameters of one sub-block kind at a share (the model profile: [c0, c1] or a constant)."""
        return self.params.kind(kind, units)

    def _layer_count(self, counts: Counts, plan: Plan, j: int) -> float:
        att, mlp, _ = self._kinds(plan, j)
        return counts.per_layer(att, mlp)

    def layer_params_of(self, plan: Plan, j: int) -> float:
        return self._layer_count(self.params, plan, j)

    def summed_layer_params_of(self, plan: Plan, j: int) -> float:
        """Trained parameters of one layer at rank j whose gradients the Galaxy group sums
        (galaxy.parallel.grad_sync): the sequence-parallel sub-blocks' weights, which saw only this
        rank's tokens, and under a method the whole parts of TP sub-blocks (LoRA's A of a column-
        parallel projection, B of a row-parallel one) and what runs on the CON layout under CON SP."""
        if plan.group == 1:
            return 0.0
        t = self.trainable
        (ak, au), (mk, mu), _ = self._kinds(plan, j)
        whole_tp = not self.trains_backbone       # full fine-tuning: as costed before methods
        out = 0.0
        for kind, units in ((ak, au), (mk, mu)):
            if kind.endswith("_sp"):
                out += t.kind(kind, units)
            elif whole_tp:
                out += t.whole_part(kind)
        if plan.con == "SP":
            out += t.kind("con", 0) + t.kind("side", 0)
        return out

    def _count(self, counts: Counts, plan: Plan, p: int, j: int) -> float:
        n = plan.stages[p] * self._layer_count(counts, plan, j) + counts.other
        if p == 0:
            n += counts.embed
        if p == plan.pp - 1:
            n += counts.head
        if plan.pp == 1:
            n -= counts.tied
        return n

    def params_of(self, plan: Plan, p: int, j: int) -> float:
        """Parameters rank j of stage p holds (frozen ones too)."""
        return self._count(self.params, plan, p, j)

    def trainable_of(self, plan: Plan, p: int, j: int, held: float | None = None) -> float:
        """Parameters rank j of stage p trains: gradients, optimizer state and step, gradient sync
        (held: params_of's answer, when known: all of them under full fine-tuning)."""
        if held is not None and self.trainable is self.params:
            return held
        return self._count(self.trainable, plan, p, j)

    def summed_outside_of(self, plan: Plan, p: int) -> float:
        """Trained parameters outside the layers that stage p's Galaxy group sums (a method's side
        input and output under CON SP); full fine-tuning's are in the closed forms."""
        if plan.group == 1 or plan.con != "SP":
            return 0.0
        s = self.summed_outside
        return s.get("other", 0) + (s.get("embed", 0) if p == 0 else 0) + (s.get("head", 0) if p == plan.pp - 1 else 0)

    def _act(self, kind: str, units: float, acts: dict | None = None) -> float:
        c0, c1 = (acts or self.acts).get(kind, (0.0, 0.0))
        return c0 + c1 * units

    def layer_act_per_row(self, plan: Plan, j: int, full: bool = False) -> tuple[float, float]:
        """(bytes a layer saves per row, the largest sub-block's) at rank j's shares: its four
        sub-blocks', and the side block's under side-tuning (whose backbone saves nothing).
        full: the four sub-blocks' as full fine-tuning saves them."""
        (ak, au), (mk, mu), con = self._kinds(plan, j)
        if not self.backward_through_backbone:
            side = self._act("side", con)
            return side, side
        acts = self.full_acts if full else self.acts
        parts = (self._act(ak, au, acts), self._act(mk, mu, acts), self._act("con", con, acts),
                 self._act("con", con, acts))
        return sum(parts), max(parts)

    def forward_working_per_row(self, plan: Plan, j: int) -> float:
        """Bytes per row a backbone sub-block run without autograd makes while it runs (side-tuning:
        its intermediates live until it returns): the largest sub-block's activations."""
        if self.backbone != "forward":
            return 0.0
        (ak, au), (mk, mu), con = self._kinds(plan, j)
        full = lambda kind, units: self.full_acts[kind][0] + self.full_acts[kind][1] * units   # noqa: E731
        return max(full(ak, au), full(mk, mu), full("con", con))

    def stage_ranks(self, plan: Plan, p: int) -> list[int]:
        """The launch ranks holding stage p (its mesh positions, through plan.rank_order)."""
        g, dp = plan.group, plan.dp
        return [plan.launch_rank((p * dp + d) * g + j) for d in range(dp) for j in range(g)]

    @staticmethod
    def in_flight(plan: Plan, p: int) -> int:
        """Micro-batches whose activations stage p holds at once: its warm-up forwards (gpipe: m;
        1f1b: min(m, pp - p), or its pipeline_warmup_list entry)."""
        if plan.pp == 1:
            return 1
        return plan.stage_warmup(p)

    @staticmethod
    def fragmented(plan: Plan, p: int) -> float:
        """Micro-batches of activations, beyond those in flight, whose freed blocks stage p's heap
        holds at its peak, for the activation slack to count (FRAGMENT_SHARE of each; none without
        a pipeline: not measured there). A stage that alternates one forward and one backward
        frees each micro-batch's activations before the next one's, yet glibc's heap (kept by
        cpu_allocator keep) still grows step over step: the freed blocks come back split by what
        a backward allocated among them, so the next forward extends the heap. Traced on loopback
        (home3's searched pipeline, mallinfo2 around every pass): the last stage, 3 layers, 1 in
        flight, held 17 MiB of activations at a time and 80-110 MiB free in its heap by step 3;
        the first stage, 8 in flight, hardly more than its slack. Fitted on the testbed's cgroup
        peaks (bench/plan_cluster.py --repredict over 7 full fine-tuning runs of home3 and edge4,
        batch 12 and 36): FRAGMENTED_MICROBATCHES 6 at FRAGMENT_SHARE 0.4 put 755 of 795
        device-runs within 10% against 740 without (home3's stop-44 run 95 of 100 against 84;
        any of 5-8 at 0.3-0.5 gave 750-757); the LoRA runs (DP, one micro-batch) are unchanged."""
        if plan.pp == 1:
            return 0.0
        return FRAGMENT_SHARE * max(0, min(FRAGMENTED_MICROBATCHES, plan.microbatches) - ModelTerms.in_flight(plan, p))

    @staticmethod
    def past_backward(plan: Plan, p: int) -> int:
        """Micro-batches whose boundary tensors (boundary_ends) stage p holds beyond those in flight:
        m - in_flight under a pipeline (1f1b: the steady state's and cool-down's; gpipe: none), none
        without one."""
        return 0 if plan.pp == 1 else plan.microbatches - ModelTerms.in_flight(plan, p)

    def carry_bytes(self, row_tokens: float) -> tuple[float, float]:
        """Bytes a stage sends forward and back per micro-batch (row_tokens: rows x CON tokens): the
        carry and its gradient; a backbone without autograd sends no gradient, side-only no
        backbone carry; the side state travels both ways."""
        backbone = self.carry * row_tokens * self.hidden * FP32 if self.backbone != "absent" else 0.0
        side = row_tokens * self.side_width * FP32
        if self.backward_through_backbone:
            return backbone, backbone
        return backbone + side, side

    def boundary_per_row(self, plan: Plan, p: int, s_con: int) -> float:
        """Bytes per row of one micro-batch's tensors at stage p's boundaries that the stage keeps
        until its step ends (boundary_ends: the carry and its gradient at each end it has; s_con:
        the CON tokens of a rank's carry)."""
        return sum(boundary_ends(plan, p)) * sum(self.carry_bytes(s_con))
