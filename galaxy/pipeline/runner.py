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
  4. Galaxy's "sum" rule (GradientSync) within the stage's Galaxy group; a weight several stages
     hold copies of (tied across the ends, T5's position bias over a stack split between
     stages) gets the sum of the copies' gradients (galaxy.pipeline.tied);
  5. the loss: summed on the last stage, averaged over replicas, broadcast to every stage (with
     the counts riding along with it, galaxy.parallel.loss_scale.riding_with_the_loss).

Send/receive buffers are static: shapes follow from the plan and the batch ([rows / n, s_con,
width] per travelling carry tensor, galaxy.pipeline.carry: an encoder-decoder's depend on the
boundary), so no metadata exchange or trial forward runs; one schedule is kept per batch shape. Under ladder side-tuning the
backbone's tensors travel without gradients (the backbone runs without autograd) and only the
side state's gradient comes back; under side-only only the side state travels. A stage below the
first one that trains (LoRA targets in later stages' layers only) runs forward only, and nothing
crosses its boundaries backward (StageInfo.grad_from, galaxy.pipeline.carry).
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from galaxy.parallel.data_parallel import wrap_data_parallel
from galaxy.parallel.grad_sync import GradientSync
from galaxy.parallel.loss_scale import current_rider, loss_scale, mean_over_replicas, total_loss_units
from galaxy.parallel.runner import Runner
from galaxy.pipeline.schedule import make_schedule, schedule_class
from galaxy.pipeline.carry import carry_dtype, carry_shapes, example_carry, stage_slots, unpack_carry
from galaxy.pipeline.stage import StageModule
from galaxy.pipeline.tied import TiedWeightSync


class PipelineRunner(Runner):
    def __init__(self, model, plan, mesh, *, device=None, autocast=nullcontext):
        """plan: its micro-batches, schedule (with its warm-ups) and dp_sharding apply here."""
        super().__init__(model, mesh, autocast)
        self.plan, self.n, self.schedule_name = plan, plan.microbatches, plan.schedule
        self.device = torch.device(device or "cpu")
        self.sharding = plan.dp_sharding if mesh.dp_pg is not None else "none"
        self.stage_module, self.whole = StageModule(model), None
        at = model.attached
        at.stage = replace(at.stage, grad_from=first_trained_layer(model, mesh, plan.stage_layers(), self.device))
        # A stage with nothing trainable at or below it runs forward only: its output carries no
        # gradient back, so no backward waits for one (torch's stage: has_backward False).
        self.backward = at.is_last_stage or at.stage.layers.stop > at.stage.grad_from
        trains = any(p.requires_grad for p in model.parameters())
        if self.sharding == "none":     # DDP refuses a module with nothing to train (and needs none)
            self.module = wrap_data_parallel(self.stage_module, mesh.dp_pg if trains else None, self.device)
        else:       # the stage module itself becomes the FSDP root
            from galaxy.parallel.sharded_dp import WholeGradients, shard_replicas   # see DataParallelRunner
            self.module = shard_replicas(model, self.stage_module, mesh, self.sharding)
            self.whole = WholeGradients(model, mesh.dp_pg)      # what FSDP cannot shard
        # DDP writes its average back into .grad after backward and FSDP replaces .grad with its
        # shard: the Galaxy sums cannot start during backward then (galaxy.parallel.grad_sync).
        self.sync = GradientSync(model, mesh.galaxy.pg, overlap=mesh.dp_pg is None)
        self.tied = TiedWeightSync(model, mesh, plan.stage_layers())     # weights on several stages
        self._schedules: dict[tuple[int, int], object] = {}
        self._total_units = None
        # An unknown name, or warm-ups a schedule cannot run, fail here, not at the first step.
        schedule_class(plan.schedule, dist.get_backend(mesh.pp_pg), plan.warmup)

    # --- training -----------------------------------------------------------------------------

    def step(self, batch: dict) -> torch.Tensor:
        """batch: this replica's rows, on every stage (each stage uses what it needs)."""
        m, mesh = self.model, self.mesh
        kwargs = stage_keywords(m, batch)
        rows, seq_len = kwargs["attention_mask"].shape                   # [B, S]
        if rows % self.n:
            raise ValueError(f"{rows} rows per replica are not divisible by num_microbatches {self.n}")
        schedule = self._schedule_for(rows // self.n, seq_len, target_length(kwargs))
        args = (batch["input_ids"],) if m.attached.is_first_stage else ()
        target, losses = None, None
        if m.attached.is_last_stage:
            target, losses = batch["labels"], []
            self._total_units = total_loss_units(m, target, mesh.dp_pg, self.plan.replica_rows)
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
        _, loss = self.model.head(unpack_carry(carry, stage_slots(self.model)[1]), labels)
        return loss.float() * loss_scale(self.model, labels, self._total_units, self.mesh.dp_size)

    def _schedule_for(self, rows: int, seq_len: int, target_len: int | None):
        key = (rows, seq_len, target_len)
        if key not in self._schedules:
            m, mesh, layers = self.model, self.mesh, self.model.attached.stage.layers
            received, sent = (example_carry(m, self.plan.con_layout, rows, seq_len, carry_dtype(m), target_len, after)
                              for after in (layers.start, layers.stop))
            inputs = (torch.empty(rows, seq_len, dtype=torch.long, device="meta"),) if m.attached.is_first_stage else received
            stage = PipelineStage(self.module, mesh.pp_rank, mesh.pp_size, self.device,
                                  input_args=inputs, output_args=sent, group=mesh.pp_pg)
            self._schedules[key] = make_schedule(self.schedule_name, stage, self.n,
                                                 self._loss if self.backward else None, self.plan.warmup)
        return self._schedules[key]

    def _from_last_stage(self, t: torch.Tensor) -> torch.Tensor:
        dist.broadcast(t, src=dist.get_global_rank(self.mesh.pp_pg, self.mesh.pp_size - 1),
                       group=self.mesh.pp_pg)
        return t

    # --- evaluation ---------------------------------------------------------------------------

    @torch.no_grad()
    def __call__(self, input_ids=None, attention_mask=None, token_type_ids=None, labels=None, **stack_inputs):
        """Forward only, the whole batch at once, stage after stage: (logits, loss) on every rank.

        Same signature and result as the model's forward (logits as the last stage's Galaxy rank
        holds them; stack_inputs: an encoder-decoder's decoder_input_ids, decoder_attention_mask).
        Every stage needs attention_mask (or input_ids, for an all-ones mask).
        """
        m, mesh = self.model, self.mesh
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids,
                 "labels": labels, **stack_inputs}
        kwargs = stage_keywords(m, batch)
        rows, seq_len = attention_mask.shape
        pg, prev, nxt = mesh.pp_pg, mesh.pp_rank - 1, mesh.pp_rank + 1
        layers = m.attached.stage.layers
        with self.autocast():
            if m.attached.is_first_stage:
                inputs = (input_ids,)
            else:
                inputs = [torch.empty(shape, dtype=carry_dtype(m), device=self.device)
                          for shape, _ in carry_shapes(m, self.plan.con_layout, rows, seq_len,
                                                       target_length(kwargs), layers.start)]
                for t in inputs:
                    dist.recv(t, src=dist.get_global_rank(pg, prev), group=pg)
            # The stage module, not DDP around it (evaluation syncs nothing); under dp_sharding it
            # is the FSDP root, whose forward gathers the stage's own parameters (layers: theirs).
            packed = self.stage_module(*inputs, **kwargs)
            if not m.attached.is_last_stage:
                for t in packed:
                    dist.send(t.contiguous(), dst=dist.get_global_rank(pg, nxt), group=pg)
                out = [None]
            else:
                out = [m.head(unpack_carry(packed, stage_slots(m)[1]), labels)]
        if self.sharding != "none":
            from galaxy.parallel.sharded_dp import reshard_all     # imported when sharding began
            reshard_all(self.module)     # the root keeps its parameters gathered after forward
        dist.broadcast_object_list(out, src=dist.get_global_rank(pg, mesh.pp_size - 1), group=pg,
                                   device=self.device if self.device.type == "cuda" else None)
        logits, loss = out[0]
        return logits.to(self.device), None if loss is None else loss.to(self.device)


def first_trained_layer(model, mesh, stage_layers: list[range], device) -> int:
    """The first layer of the first stage holding a trainable parameter (the model's layer count
    when none does): StageInfo.grad_from. Collective over the pp group: each stage knows only its
    own parameters."""
    trains = torch.tensor([any(p.requires_grad for p in model.parameters())], dtype=torch.int64, device=device)
    flags = [torch.zeros_like(trains) for _ in range(mesh.pp_size)]
    dist.all_gather(flags, trains, group=mesh.pp_pg)
    return next((layers.start for layers, f in zip(stage_layers, flags) if f.item()), stage_layers[-1].stop)


def stage_keywords(model, batch: dict) -> dict:
    """The keyword tensors of this stage's forward ([rows, ...] each; pipelining cuts them into
    micro-batches): the source's attention_mask on every stage, token_type_ids on the first; an
    encoder-decoder's decoder_attention_mask [rows, T] on every stage (all ones when the batch has
    none, as the model's forward takes it) and decoder_input_ids on the first (the batch's, or
    what the model's forward makes: the labels shifted right). The last stage gets what its head
    reads beyond the carry, from the source ids (model.head_inputs, if it has one: the
    encoder-decoder classifiers' pooled positions [rows])."""
    first = model.attached.is_first_stage
    kwargs = {"attention_mask": batch["attention_mask"]}
    if model.attached.is_last_stage and hasattr(model, "head_inputs"):
        kwargs.update(model.head_inputs(batch["input_ids"], batch["attention_mask"]))
    if first and batch.get("token_type_ids") is not None:
        kwargs["token_type_ids"] = batch["token_type_ids"]
    if model.encoder_layers:
        labels = batch.get("labels") if model.task == "seq2seq" else None
        ids = model.decoder_inputs(batch["input_ids"], batch.get("decoder_input_ids"), labels)
        mask = batch.get("decoder_attention_mask")
        kwargs["decoder_attention_mask"] = torch.ones_like(ids) if mask is None else mask
        if first:
            kwargs["decoder_input_ids"] = ids
    return kwargs


def target_length(kwargs: dict) -> int | None:
    """An encoder-decoder's target length T (stage_keywords' target mask), else None."""
    mask = kwargs.get("decoder_attention_mask")
    return None if mask is None else mask.shape[1]
