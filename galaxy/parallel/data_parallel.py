"""Data parallelism: replicas of a model (a Galaxy group, or a pipeline stage) average gradients.

Gradient averaging is torch's DistributedDataParallel over the mesh's dp process group: it
all-reduces gradient buckets while backward still runs, overlapping communication with compute.
DDP only hooks parameter gradients, so it coexists with Galaxy's autograd collectives inside the
model (those run on the Galaxy group, DDP's on the dp group). Galaxy's "sum" rule (GradientSync,
after backward) and DDP's average are both linear, so their order does not matter: every rank ends
with sum over its Galaxy group of the mean over replicas, as docs/design.md section 3 asks.

With dp_sharding ("full" or "no_reshard") the replicas shard instead of replicating: torch FSDP2
over the mesh's dp sub-mesh (galaxy.parallel.sharded_dp) reduce-scatters the gradients, and
GradientSync's Galaxy sum then runs on each rank's reduce-scattered slice.

A comm hook reports every DDP bucket to galaxy's communication recorder
(collectives.comm_recorder) before the usual averaging all-reduce, so byte counts of DDP and
Galaxy runs come from the same place.
"""
from __future__ import annotations

import inspect
from contextlib import nullcontext

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from galaxy.distributed import collectives
from galaxy.parallel.grad_sync import GradientSync
from galaxy.parallel.loss_scale import loss_scale, mean_over_replicas, total_loss_units
from galaxy.parallel.runner import Runner


_DDP_ARGS = inspect.signature(DistributedDataParallel.__init__).parameters


def _recorded_allreduce(pg, bucket):
    if collectives.comm_recorder is not None:
        collectives.comm_recorder("all_reduce", bucket.buffer(), pg.size())
    return default_hooks.allreduce_hook(pg, bucket)       # sum, then divide by the group size


def wrap_data_parallel(module: nn.Module, dp_pg, device=None) -> nn.Module:
    """DDP over dp_pg (or the module itself when there is one replica)."""
    if dp_pg is None:
        return module
    device = torch.device(device or "cpu")
    # Buffers (rotary tables) are constants: no need to re-broadcast them every forward.
    quiet = ({"forward_sync_buffers": False} if "forward_sync_buffers" in _DDP_ARGS
             else {"broadcast_buffers": False})
    # No broadcast of rank 0's parameters at construction: every replica has read the same
    # checkpoint and drawn its new tensors from the same seed (docs/design.md section 5), so it would
    # overwrite equal values, through a coalesced copy of every parameter and buffer, frozen ones
    # included (all-MiniLM-L6-v2: 87 MiB more at the start, the whole run's peak under LoRA).
    if "init_sync" in _DDP_ARGS:
        quiet["init_sync"] = False
    # Gradients live in DDP's buckets (views), so backward writes them there directly: no copy into
    # the buckets before the all-reduce and back after it, and no second copy of every gradient
    # (all-MiniLM-L6-v2: 87 MiB per rank, and about 60 ms of copying per CPU step).
    ddp = DistributedDataParallel(module, process_group=dp_pg, gradient_as_bucket_view=True,
                                  device_ids=[device] if device.type == "cuda" else None, **quiet)
    ddp.register_comm_hook(dp_pg, _recorded_allreduce)
    return ddp


def split_rows(batch: dict, n: int) -> list[dict]:
    """n equal micro-batches of a batch's rows, in order."""
    rows = next(iter(batch.values())).shape[0]
    if rows % n:
        raise ValueError(f"{rows} rows per replica cannot be split into {n} equal micro-batches")
    pieces = {k: v.chunk(n) for k, v in batch.items()}
    return [{k: v[i] for k, v in pieces.items()} for i in range(n)]


class DataParallelRunner(Runner):
    """Forward and backward of one global batch on dp replicas of a Galaxy-group model.

    Every replica gets its own rows (batch_size / dp, or its plan.replica_rows entry; it reads no
    other rows) and runs them in
    the plan's micro-batches (grad_accum_steps); DDP averages over replicas at the last micro-batch only.
    With dp 1 this is plain Galaxy training (no DDP), so one runner serves every pp 1 mesh.

    dp_sharding "full" / "no_reshard" (with dp > 1): FSDP2 instead of DDP. "full" reduce-scatters
    every micro-batch's gradients (they stay sharded between micro-batches); "no_reshard" keeps
    parameters and accumulated gradients whole until the last micro-batch, as DDP does, and
    reduce-scatters once per step.
    """

    def __init__(self, model: nn.Module, plan, mesh, *, device=None, autocast=nullcontext):
        """plan: its micro-batches (gradient accumulation) and dp_sharding apply here."""
        super().__init__(model, mesh, autocast)
        self.accum, self.replica_rows = plan.microbatches, plan.replica_rows
        self.sharding = plan.dp_sharding if mesh.dp_pg is not None else "none"
        self.whole = None
        if self.sharding == "none":
            self.module = wrap_data_parallel(model, mesh.dp_pg, device)
        else:       # model itself becomes the FSDP root: self.module is self.model
            # Imported here: FSDP's import costs as much as torch's, and unsharded runs never need it.
            from galaxy.parallel.sharded_dp import WholeGradients, shard_replicas
            self.module = shard_replicas(model, model, mesh, self.sharding)
            self.whole = WholeGradients(model, mesh.dp_pg)      # what FSDP cannot shard
        self.sync = GradientSync(model, mesh.galaxy.pg)     # after sharding: it keeps the parameters

    def _micro_batch(self, last: bool):
        """The context of one micro-batch's forward and backward: gradients are synchronised at the
        last one only (DDP's no_sync before it), except under full sharding, where FSDP
        reduce-scatters every micro-batch's so that whole gradients never accumulate."""
        if self.sharding != "none":
            self.module.set_requires_gradient_sync(last or self.sharding == "full")
            return nullcontext()
        return nullcontext() if last or self.module is self.model else self.module.no_sync()

    def step(self, batch: dict) -> torch.Tensor:
        """batch: this replica's rows. Leaves synchronised gradients; returns the global-batch mean loss."""
        mesh, micro = self.mesh, split_rows(batch, self.accum)
        total = total_loss_units(self.model, batch["labels"], mesh.dp_pg, self.replica_rows)
        local = torch.zeros((), device=batch["labels"].device)
        for i, mb in enumerate(micro):
            last = i == len(micro) - 1
            with self._micro_batch(last):
                with self.autocast():
                    _, loss = self.module(**mb)
                scaled = loss.float() * loss_scale(self.model, mb["labels"], total, mesh.dp_size)
                scaled.backward()
            local = local + scaled.detach()
        if self.whole is not None:
            self.whole()
        self.sync()
        return mean_over_replicas(local, mesh.dp_pg, mesh.dp_size)

    def __call__(self, *args, **kwargs):
        """The model's own forward (evaluation): every replica runs what it is given.
        Sharded replicas free what the forward gathered (the FSDP root keeps its parameters
        gathered for a backward that evaluation never runs)."""
        out = self.model(*args, **kwargs)
        if self.sharding != "none":
            from galaxy.parallel.sharded_dp import reshard_all     # imported when sharding began
            reshard_all(self.model)
        return out
