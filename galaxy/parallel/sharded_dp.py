"""Sharded data parallelism (config key dp_sharding): torch FSDP2 over the mesh's dp axis.

Each rank's part of the model (its Galaxy shards, of its pipeline stage) is split once more,
along dim 0 of every parameter, over the data-parallel replicas that hold the same part (the
mesh's dp sub-mesh). One FSDP unit per transformer layer (and per side-network block, which the
model calls outside its layer's forward), one for the embeddings unless a weight ties them to the
head, plus the root (the head and what remains), so that one layer's parameters are gathered at a
time:

  forward    all-gather a layer's parameters (dp), run it, free them again ("full", ZeRO-3
             like) or keep them until backward ("no_reshard", ZeRO-2 like)
  backward   all-gather again where freed, compute the gradients, reduce-scatter them over dp:
             every rank keeps the mean over replicas of its own dim-0 slice

FSDP cannot shard a 0-d parameter (ladder side-tuning's gates): those stay whole on every
replica, outside FSDP, and `WholeGradients` averages their gradients over the replicas as DDP
would.

Parameters, gradients and optimizer state become DTensors (torch.distributed.tensor) sharded
Shard(0) on the dp sub-mesh; `local` and `full` (dtensors.py) turn them back into plain tensors for the
code that reads them (gradient rules, clipping, gathers, checkpoints) without
importing FSDP.

Galaxy groups inside each replica are unaffected: every rank of a Galaxy group shards its own
local TP shard, or its copy of a replicated parameter, over the ranks holding the same part in
the other replicas. A replicated ("sum" rule) parameter has the same shape on every Galaxy rank,
so the dp slice a rank keeps is the same slice on every rank of its Galaxy group: the Galaxy
all-reduce of the sum rule (GradientSync) runs on the reduce-scattered slices, after FSDP,
and sums exactly what it would have summed before (both are linear; the dp mean is taken once,
by FSDP's reduce-scatter, as DDP's all-reduce takes it without sharding).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from galaxy.distributed import waiting
from galaxy.plan import DP_SHARDING


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules that get their own FSDP unit, innermost first (fully_shard goes bottom-up):
    each side-network block (called by run_layers outside its layer's forward), each layer, and
    the embeddings (the first stage's modules: a vocabulary table can be half a small model),
    unless a weight ties them to another module (Llama's tie_word_embeddings within one stage),
    which then stays with it in the root."""
    units = [layer.side for layer in model.layers if isinstance(getattr(layer, "side", None), nn.Module)]
    units += list(model.layers)
    for name in model.first_stage_modules:
        module = getattr(model, name, None)
        if isinstance(module, nn.Module) and any(True for _ in module.parameters()) and not _tied_outside(model, module):
            units.append(module)
    return units


def _tied_outside(model: nn.Module, module: nn.Module) -> bool:
    mine = {id(p) for p in module.parameters()}
    inside = {id(m) for m in module.modules()}
    return any(id(p) in mine for m in model.modules() if id(m) not in inside
               for p in m.parameters(recurse=False))


def shard_replicas(model: nn.Module, root: nn.Module, mesh, mode: str) -> nn.Module:
    """Apply FSDP2 to `model`'s layers and to `root` (the model itself, or the pipeline's stage
    module around it) over mesh's dp sub-mesh; returns root, now an FSDPModule.

    mode "full": a layer's gathered parameters are freed after its forward and gathered again in
    backward; "no_reshard": they stay until backward. The root keeps its own (the head, and
    embeddings tied to it: the head runs last in forward and first in backward) until backward
    in both modes.
    """
    if mode not in DP_SHARDING[1:]:
        raise ValueError(f"dp_sharding must be one of {DP_SHARDING[1:]} here, got {mode!r}")
    dp_mesh, whole = mesh.device_mesh["dp"], set(unshardable(model))
    after_forward = mode == "full"
    for unit in fsdp_units(model):
        fully_shard(unit, mesh=dp_mesh, reshard_after_forward=after_forward, ignored_params=whole)
    # None: torch's default for the root, which keeps its parameters gathered from forward to backward.
    fully_shard(root, mesh=dp_mesh, reshard_after_forward=None if after_forward else False, ignored_params=whole)
    return root


def unshardable(model: nn.Module) -> list[nn.Parameter]:
    """Parameters FSDP cannot shard (0-d ones), which stay whole on every replica."""
    return [p for p in model.parameters() if p.dim() == 0]


class WholeGradients:
    """After backward: the mean over replicas of the gradients of the parameters left whole
    (`unshardable`), one flat all-reduce over the dp group, as DDP averages every gradient."""

    def __init__(self, model: nn.Module, dp_pg):
        self.dp_pg, self.params = dp_pg, [p for p in unshardable(model) if p.requires_grad]

    @torch.no_grad()
    def __call__(self) -> None:
        grads = [p.grad for p in self.params if p.grad is not None]
        if self.dp_pg is None or not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        waiting.all_reduce(flat, group=self.dp_pg)
        flat /= dist.get_world_size(self.dp_pg)
        for g, mean in zip(grads, flat):
            g.copy_(mean)


def reshard_all(module: nn.Module) -> None:
    """Free every gathered parameter of `module`'s FSDP units (after a forward outside training,
    e.g. evaluation, whose root would otherwise stay gathered)."""
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
