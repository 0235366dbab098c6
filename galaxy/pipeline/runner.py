"""Pipeline-parallel training of one model: this rank runs one stage of a Galaxy group.

Stage p of replica d is the Galaxy group at mesh coordinates (p, d); its rank r exchanges
activations with rank r of stages p - 1 and p + 1 over the mesh's pp group (shards of
corresponding ranks have identical shapes, so every send has a matching receive). Within a step:

  1. this replica's rows are cut into num_microbatches micro-batches;
  2. the schedule (gpipe | 1f1b) runs them: the first stage embeds, every stage runs its layers,
     the last stage's loss function runs the head and scales each micro-batch's loss
     (galaxy.parallel.loss_scale) so that the scaled losses add up to the global-batch mean;
  3. data parallelism: the stage module is wrapped in DDP over the dp group; pipelining keeps
     DDP quiet until the last micro-batch's backward, which all-reduces the accumulated gradients.
     With dp_sharding the stage module is the FSDP2 root instead, one unit per layer
     (galaxy.parallel.sharded_dp); pipelining accumulates the micro-batches' gradients whole and
     reduce-scatters them once, after the last backward;
  4. Galaxy's "sum" rule (GradientSync) within the stage's Galaxy group; a weight tied across
     the first and last stage gets the sum of both ends' gradients (galaxy.pipeline.tied);
  5. the loss: summed on the last stage, averaged over replicas, broadcast to every stage (with
     the counts riding along with it, galaxy.parallel.loss_scale.riding_with_the_loss).

Send/receive buffers are static: shapes follow from the plan and the batch ([rows / n, s_con,
width] per travelling carry tensor, galaxy.pipeline.stage.carry_slots), so no metadata exchange
or trial forward runs; one schedule is kept per batch shape. Under ladder side-tuning the
backbone's tensors travel without gradients (the backbone runs without autograd) and only the
side state's gradient comes back; under side-only only the side state travels.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from galaxy.parallel.data_parallel import wrap_data_parallel
from galaxy.parallel.grad_sync import GradientSync
from galaxy.parallel.loss_scale import current_rider, loss_scale, mean_over_replicas, total_loss_units
from galaxy.parallel.runner import Runner
from galaxy.parallel.sharded_dp import WholeGradients, reshard_all, shard_replicas
from galaxy.pipeline.schedule import make_schedule, schedule_class
from galaxy.pipeline.stage import StageModule, carry_dtype, carry_shapes, carry_slots, example_carry, unpack_carry
from galaxy.pipeline.tied import TiedWeightSync


class PipelineRunner(Runner):
    def __init__(self, model, plan, mesh, *, device=None, autocast=nullcontext):
        """plan: its micro-batches, schedule and dp_sharding apply here."""
        super().__init__(model, mesh, autocast)
        self.plan, self.n, self.schedule_name = plan, plan.microbatches, plan.schedule
        self.device = torch.device(device or "cpu")
        self.sharding = plan.dp_sharding if mesh.dp_pg is not None else "none"
        self.stage_module, self.whole = StageModule(model), None
        if self.sharding == "none":
            self.module = wrap_data_parallel(self.stage_module, mesh.dp_pg, self.device)
        else:       # the stage module itself becomes the FSDP root
            self.module = shard_replicas(model, self.stage_module, mesh, self.sharding)
            self.whole = WholeGradients(model, mesh.dp_pg)      # what FSDP cannot shard
        # DDP writes its average back into .grad after backward and FSDP replaces .grad with its
        # shard: the Galaxy sums cannot start during backward then (galaxy.parallel.grad_sync).
        self.sync = GradientSync(model, mesh.galaxy.pg, overlap=mesh.dp_pg is None)
        self.tied = TiedWeightSync(model, mesh)      # tie_word_embeddings across the ends
        self._schedules: dict[tuple[int, int], object] = {}
        self._total_units = None
        schedule_class(plan.schedule)     # an unknown name fails here, not at the first step

    # --- training -----------------------------------------------------------------------------

    def step(self, batch: dict) -> torch.Tensor:
        """batch: this replica's rows, on every stage (each stage uses what it needs)."""
        m, mesh = self.model, self.mesh
        mask = batch["attention_mask"]                                   # [B, S]
        rows, seq_len = mask.shape
        if rows % self.n:
            raise ValueError(f"{rows} rows per replica are not divisible by num_microbatches {self.n}")
        schedule = self._schedule_for(rows // self.n, seq_len)
        args = (batch["input_ids"],) if m.attached.is_first_stage else ()
        kwargs = {"attention_mask": mask}
        if m.attached.is_first_stage and batch.get("token_type_ids") is not None:
            kwargs["token_type_ids"] = batch["token_type_ids"]
        target, losses = None, None
        if m.attached.is_last_stage:
            target, losses = batch["labels"], []
            self._total_units = total_loss_units(m, target, mesh.dp_pg)
        with self.autocast():
            schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        if self.whole is not None:
            self.whole()
        self.sync()
        self.tied()
        rider = current_rider()      # counts the trainer sums over replicas (tokens), if any
        if m.attached.is_last_stage:
            loss = mean_over_replicas(torch.stack([x.detach() for x in losses]).sum(), mesh.dp_pg, mesh.dp_size)
            totals = () if rider is None else (rider.total.to(torch.float64),)
        else:
            loss = torch.zeros((), device=self.device)
            totals = () if rider is None else (torch.zeros(rider.local.numel(), dtype=torch.float64,
                                                           device=self.device),)
        # One broadcast carries the loss and the riders' totals to every stage (a replica's stages
        # read the same rows, so the last stage's totals are theirs).
        packed = self._from_last_stage(torch.cat([loss.reshape(1).to(torch.float64), *totals]))
        if rider is not None and not m.attached.is_last_stage:
            rider.settle(packed[1:])
        return packed[0].to(loss.dtype)

    def _loss(self, carry: tuple, labels: torch.Tensor) -> torch.Tensor:
        """The last stage's head on one micro-batch, scaled toward the global-batch mean."""
        _, loss = self.model.head(unpack_carry(carry, carry_slots(self.model)), labels)
        return loss.float() * loss_scale(self.model, labels, self._total_units, self.mesh.dp_size)

    def _schedule_for(self, rows: int, seq_len: int):
        key = (rows, seq_len)
        if key not in self._schedules:
            m, mesh = self.model, self.mesh
            carry = example_carry(m, self.plan.con_layout, rows, seq_len, carry_dtype(m))
            inputs = (torch.empty(rows, seq_len, dtype=torch.long, device="meta"),) if m.attached.is_first_stage else carry
            stage = PipelineStage(self.module, mesh.pp_rank, mesh.pp_size, self.device,
                                  input_args=inputs, output_args=carry, group=mesh.pp_pg)
            self._schedules[key] = make_schedule(self.schedule_name, stage, self.n, self._loss)
        return self._schedules[key]

    def _from_last_stage(self, t: torch.Tensor) -> torch.Tensor:
        dist.broadcast(t, src=dist.get_global_rank(self.mesh.pp_pg, self.mesh.pp_size - 1),
                       group=self.mesh.pp_pg)
        return t

    # --- evaluation ---------------------------------------------------------------------------

    @torch.no_grad()
    def __call__(self, input_ids=None, attention_mask=None, token_type_ids=None, labels=None):
        """Forward only, the whole batch at once, stage after stage: (logits, loss) on every rank.

        Same signature and result as the model's forward (logits as the last stage's Galaxy rank
        holds them). Every stage needs attention_mask (or input_ids, for an all-ones mask).
        """
        m, mesh = self.model, self.mesh
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        rows, seq_len = attention_mask.shape
        pg, prev, nxt = mesh.pp_pg, mesh.pp_rank - 1, mesh.pp_rank + 1
        slots = carry_slots(m)
        with self.autocast():
            if m.attached.is_first_stage:
                inputs = (input_ids,)
            else:
                inputs = [torch.empty(shape, dtype=carry_dtype(m), device=self.device)
                          for shape, _ in carry_shapes(m, self.plan.con_layout, rows, seq_len)]
                for t in inputs:
                    dist.recv(t, src=dist.get_global_rank(pg, prev), group=pg)
            # The stage module, not DDP around it (evaluation syncs nothing); under dp_sharding it
            # is the FSDP root, whose forward gathers the stage's own parameters (layers: theirs).
            packed = self.stage_module(*inputs, attention_mask=attention_mask, token_type_ids=token_type_ids)
            if not m.attached.is_last_stage:
                for t in packed:
                    dist.send(t.contiguous(), dst=dist.get_global_rank(pg, nxt), group=pg)
                out = [None]
            else:
                out = [m.head(unpack_carry(packed, slots), labels)]
        if self.sharding != "none":
            reshard_all(self.module)     # the root keeps its parameters gathered after forward
        dist.broadcast_object_list(out, src=dist.get_global_rank(pg, mesh.pp_size - 1), group=pg,
                                   device=self.device if self.device.type == "cuda" else None)
        logits, loss = out[0]
        return logits.to(self.device), None if loss is None else loss.to(self.device)
