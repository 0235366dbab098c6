"""The memory model: each rank's peak bytes under a plan.

Memory, per rank (MiB): the process baseline (device profile) + parameters, gradients and optimizer
state of what the rank holds (its stage, its shares; AdamW keeps two fp32 moments, SGD none) + DDP's
gradient buckets (a second copy of the gradients, dp > 1) + the Galaxy group's buckets (a second
copy of the gradients it sums: the sequence-parallel sub-blocks' weights) + the activations saved
for backward (model profile, at the rank's shares, per row) of the micro-batches in flight (1 without a
pipeline; 1f1b: min(m, pp - stage); gpipe: m) and a stage's boundary tensors of the other m - in
flight micro-batches (model_terms.boundary_ends), a checkpointed layer keeping only its input carry,
plus one layer's activations while it is recomputed, plus the largest sub-block's activations again
as backward's working space + an unfused optimizer step's temporaries (AdamW: one fp32 tensor per
parameter; a fused step, the device profile's optimizer_fused, has none). On CPU the peak is
resident memory, and glibc keeps freed activation memory, so the activations count 1.55 times
under full fine-tuning, 1.5 under a method (FULL_ACTIVATION_SLACK, FROZEN_ACTIVATION_SLACK, fitted;
the extra as if no layer were recomputed: backward still rebuilds them all) and the temporaries
come on top; on CUDA the larger of the two. With sharded
data parallelism (dp_sharding), parameters ("full") or not ("no_reshard", which keeps the gathered
parameters beside their shards), gradients and optimizer state are divided over the dp replicas;
the unsharded gradients before their reduce-scatter still count once, as DDP's buckets do.

Under a PEFT method (galaxy.planner.method) every weight is held as above (FSDP shards the frozen
ones too, and gathers them for forward and backward alike), but gradients, optimizer state and its
temporaries, DDP's and the Galaxy group's buckets and FSDP's unsharded gradients cover only the
parameters that train, and the activations are those the method saves (model profile): a frozen
projection keeps no input for a weight gradient, LoRA keeps its own; side-tuning's backbone keeps
nothing (no autograd) but makes each sub-block's intermediates while it runs, and recomputation,
which only wraps the backbone's layers, changes nothing there.

The word embedding's gradient (galaxy.parallel.embedding_grad): with more than one micro-batch its
lookups add their rows into one dense .grad in place (rows_accumulate_in_place), so a step makes
no fresh dense gradient of the table after the first and the heap keeps none beyond .grad. Where
the dense lookup stays (a head tied to the table on the same stage, FSDP's sharded replicas) each
backward after the first makes a fresh one, which a heap that keeps freed memory can keep
(kept_gradient_blocks).
"""
from __future__ import annotations

import functools
from dataclasses import replace

from galaxy.plan import Plan
from galaxy.planner.model_terms import FP32, MIB, ModelTerms
from galaxy.planner.placement import in_launch_order, is_identity, placed_model

OPT_STATE = {"adamw": 2, "sgd": 0}   # fp32 tensors per parameter the optimizer keeps
OPT_TEMP = {"adamw": 1, "sgd": 0}    # fp32 temporaries per parameter of an unfused step (AdamW: sqrt(v))
# CPU peak RSS: glibc keeps most freed activation memory in its heap, and backward's gradients of
# activations come on top: activations x (1 + slack), then + an unfused optimizer's temporaries.
# Fitted on all-MiniLM-L6-v2 (bench/plan_accuracy.py, 8 x 64 tokens, 16 plans, each rank's peak RSS),
# with a baseline that holds the tokenizer: least squares gave 0.53 for full fine-tuning, 0.86 for
# LoRA (whose backbone keeps fewer activations but makes every activation gradient) and 1.4 for
# side-tuning (hardly any activations: any slack fits); 0.7 keeps 30 of 31 ranks within 10% under
# full fine-tuning (max 11%), 31 of 31 under LoRA (max 6%), 29 of 29 under side-tuning (max 4%).
# A device profile may set its own "activation_slack". CUDA (caching allocator): max(acts, temps).
CPU_ACTIVATION_SLACK = 0.7
# Full fine-tuning alone: 0.55, its own least-squares fit above (0.53) and the edge testbed's
# (bench/plan_cluster.py --repredict, home3 and edge4, pad 128, each device's cgroup peak: 0.55
# puts 225 of 229 device-runs within 10%, 0.7 206); 0.7 stands for the methods, whose backward
# makes every activation's gradient from fewer saved activations.
FULL_ACTIVATION_SLACK = 0.55
# A frozen backbone (LoRA, adapters, side-tuning): 0.5, refitted on the edge testbed's cgroup peaks
# (bench/plan_cluster.py --method lora --repredict, edge4, pad 128): at batch 12, 0.7 and 0.5 both
# put 108 of 109 device-runs within 10%; at batch 36, 0.7 put 19 of 113 there (every replica over,
# by 7-25%: measured 45 MiB a row where 0.7 predicts 56), 0.5 110 of 113 (outside: a recomputing
# plan and the laptop alone at 36 rows, over by 11-16%).
FROZEN_ACTIVATION_SLACK = 0.5
# At most this many dense embedding gradients kept beyond .grad (kept_gradient_blocks): past it the
# freed holes of a 1f1b's steady state hold the next one (the testbed's cgroup: 12 micro-batches
# over 3 and 4 stages measured 1.2-5 blocks above the term-free prediction; 4 keeps the worst of
# them within 10%, none under).
KEPT_GRADIENTS_MAX = 4


def embedding_rows_in_place(plan: Plan, table_trains: bool, tied: bool) -> bool:
    """Whether stage 0's word embedding adds each micro-batch's rows into its .grad in place
    (galaxy.parallel.embedding_grad's rule): more than one micro-batch, the table trains, no head
    tied to it on the same stage (pp 1 with a tied pair), replicas not sharded. Every family's
    cost model asks this with its own counts (here; galaxy.planner.encdec_terms)."""
    return (plan.microbatches > 1 and table_trains and not (plan.pp == 1 and tied)
            and not (plan.dp_sharding != "none" and plan.dp > 1))


class MemoryModel(ModelTerms):
    def rows_accumulate_in_place(self, plan: Plan) -> bool:
        """embedding_rows_in_place for this model's first stage."""
        return embedding_rows_in_place(plan, self.trains_backbone and self.trainable.embed > 0, self.tied > 0)

    def recomputed(self, plan: Plan, p: int) -> int:
        """Stage p's layers that recompute in backward: none where no backward runs through them
        (galaxy.layers.block checkpoints a layer only while autograd records it)."""
        return plan.recomputed_in_stage(p) if self.backward_through_backbone else 0

    def replica_rows(self, plan: Plan) -> list[float]:
        """Rows of a global batch per replica: the plan's dp_batch_list, else an even split."""
        return list(plan.replica_rows) if plan.replica_rows is not None else [self.batch / plan.dp] * plan.dp

    @staticmethod
    def kept_gradient_blocks(plan: Plan, p: int) -> int:
        """Dense embedding gradients a heap that keeps freed memory (galaxy.runtime.cpu_allocator)
        holds beyond .grad on stage p, which holds the embeddings, where the lookup stays dense
        (not rows_accumulate_in_place). Each backward after the first
        makes a fresh gradient, adds it into .grad and frees it; where a forward comes next, its
        activations split the freed block, and the next backward's gradient extends the heap. So
        a backward grows the heap only if the one before it was followed by a forward: none under
        gpipe or a 1f1b with m <= its warm-up (every backward after the last forward), m - w - 1
        in 1f1b's steady state (w = plan.stage_warmup(p) warm-up forwards), m - 2 under plain
        accumulation (forward, backward in turn); at most KEPT_GRADIENTS_MAX (the testbed's cgroup,
        bench/plan_cluster.py, pad 128: stage 0 above the term-free prediction by 0.3 blocks of
        47 MB at 0 (pp 3, m 4), 1.2 at 1 (pp 4, m 6), 2.3 at 2 (pp 3, m 6), 1.2-5 at 7-8 (m 12),
        with the activation slack at 0.7)."""
        m = plan.microbatches
        if plan.pp == 1:
            steady = m - 1                   # every backward but the last is followed by a forward
        elif plan.schedule == "gpipe":
            steady = 0
        else:
            steady = m - plan.stage_warmup(p)
        return min(max(steady - 1, 0), KEPT_GRADIENTS_MAX)

    def estimate_memory(self, plan: Plan) -> list[float]:
        """MiB per rank (the memory half of estimate(), cheaper); a placed plan's per launch rank."""
        if not is_identity(plan.rank_order):
            order = plan.rank_order
            return in_launch_order(placed_model(self, order).estimate_memory(replace(plan, rank_order=None)), order)
        g, pp, m = plan.group, plan.pp, plan.microbatches
        rows = [r / m for r in self.replica_rows(plan)]        # one micro-batch's, per replica
        s_con = [self._kinds(plan, j)[2] for j in range(g)]
        out = [0.0] * (g * pp * plan.dp)
        for p in range(pp):
            inflight = self.in_flight(plan, p)
            for j in range(g):
                n = self.params_of(plan, p, j)
                for d in range(plan.dp):
                    r = (p * plan.dp + d) * g + j
                    out[r] = self._memory(plan, p, j, r, n, rows[d], self.recomputed(plan, p), inflight, plan.stages[p],
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
        slack = dev.get("activation_slack", FULL_ACTIVATION_SLACK if self.trains_backbone else FROZEN_ACTIVATION_SLACK)
        # The slack stands for what backward touches beside the saved activations (their gradients,
        # freed blocks the heap keeps), and backward still walks every layer's activations when it
        # rebuilds them: recomputation saves the saved activations once, not 1 + slack times
        # (bench/plan_accuracy.py: Galaxy with every layer recomputed measured 751-760 MiB against
        # 684 predicted at 1 + slack; serial 834, 794 predicted, 880 now).
        # A frozen backbone's backward still makes every activation's gradient, as full fine-tuning's
        # does, though it saved less (bench/plan_accuracy.py --peft lora: 16 plans' ranks within
        # 2.6% (median) with full fine-tuning's activations here, 4.9% under with LoRA's own).
        # The heap's split free blocks of a stage with few micro-batches in flight (fragmented)
        # count among those activations too.
        frozen, spread = self.backbone == "frozen", inflight + self.fragmented(plan, p)
        whole = acts if not (c or frozen or spread > inflight) else \
            self._memory_parts(plan, p, j, n, rows, 0, spread, L, s_con, first, last, frozen)[1]
        kept = 0.0
        if dev.get("freed_memory_kept") and first and not self.rows_accumulate_in_place(plan):
            kept = self.kept_gradient_blocks(plan, p) * self.trainable.embed * FP32
        return dev.get("baseline_mib", 0.0) * MIB + state + acts + slack * whole + temp + kept

    @functools.lru_cache(maxsize=65536)
    def _memory_parts(self, plan, p, j, n, rows, c, inflight, L, s_con, first, last,
                      backbone_acts: bool = False) -> tuple[float, float, float]:
        """(weights, gradients, optimizer state and the buckets' gradient copies; activations at the
        backward's peak; an unfused optimizer step's temporaries) in bytes. backbone_acts: the
        layers' activations as full fine-tuning saves them."""
        dp = plan.dp
        sharded = plan.dp_sharding != "none" and dp > 1
        weights = n / dp if sharded else n
        if sharded and plan.dp_sharding == "full":
            weights += 2 * self.layer_params_of(plan, j)          # a layer gathered, the next prefetched
        elif sharded:                                             # no_reshard: the gathered parameters stay
            weights += n                                          # beside their shards until the step ends
        t = self.trainable_of(plan, p, j, n)                      # what grads and optimizer state cover
        held = t / dp if sharded else t
        opt = OPT_STATE.get(self.optimizer, 0) * held
        # A second copy of the gradients: DDP's buckets (its gradients are views of them, but
        # backward makes each gradient afresh after zero_grad(set_to_none) and the bucket takes a copy);
        # under sharding, each unit's unsharded gradients before their reduce-scatter (freed unit by
        # unit, but the allocator keeps the memory: bench/plan_memory.py measured 929 MiB where the
        # shards alone predicted 728).
        buckets = t if dp > 1 else 0
        # The Galaxy group's "sum" gradients are flattened into their all-reduce buckets: one more
        # copy, in buffers GradientSync keeps from step to step.
        summed = L * self.summed_layer_params_of(plan, j) + self.summed_outside_of(plan, p)
        buckets += summed / (dp if sharded else 1)
        layer, biggest = self.layer_act_per_row(plan, j, backbone_acts)
        biggest = max(biggest, self.forward_working_per_row(plan, j))
        carry = self.carry * s_con * self.hidden * FP32
        per_mb = (L - c) * layer + c * carry
        if first:
            per_mb += self._act("embed", self.seq)
        if last:
            per_mb += self._act("head", s_con)
        # The boundary tensors of the micro-batches past their backward (model_terms.boundary_ends;
        # none without a pipeline): the slack counts them as activations, the heap's freed blocks
        # around them included. Those of the micro-batches in flight are taken as inside the
        # activations' slack: gpipe, all in flight, grew 7.9 MiB a micro-batch on a two-layer
        # stage (loopback, pp 3, one row, m 4 to 36) against the activations' 17.4 with the
        # slack, and its edge4 runs measured 3-11% under the prediction at m 9-18 (batch 36).
        # edge4 at batch 36 (bench/plan_cluster.py --repredict): 118 of 133 device-runs within
        # 10% with the term, 98 without (the 1f1b plans' later stages 7-18% over at m 18-36).
        boundary = self.past_backward(plan, p) * self.boundary_per_row(plan, p, s_con)
        acts = rows * (inflight * per_mb + (layer if c else 0) + biggest + boundary)
        temp = OPT_TEMP.get(self.optimizer, 0) * held * FP32
        return FP32 * (weights + held + opt + buckets), acts, temp
