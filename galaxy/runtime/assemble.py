"""Assemble this rank's part of a model: build on meta, apply the plan, prune to the pipeline
stage, then read only the kept slices of the checkpoint."""
from __future__ import annotations

import torch
from torch import nn

from galaxy.distributed.group import GalaxyGroup
from galaxy.layers.rng import ShardedRNG
from galaxy.models.build import load_hf_config, load_hf_weights, locate_weights, model_class, tie_as_checkpoint
from galaxy.models.registry import family_of
from galaxy.models.weights import LazyCheckpoint
from galaxy.parallel.plan import apply_plan
from galaxy.pipeline.stage import keep_stage
from galaxy.plan import Plan, recompute_layers


def build_model(model_path: str, plan: Plan, group: GalaxyGroup, *, num_labels: int | None = None,
                seed: int = 0, device: torch.device | str = "cpu", dropout: float | None = None,
                stage: tuple[range, bool, bool] | None = None, task: str | None = None) -> nn.Module:
    """This rank's part of the model: its shard under `plan`, of its pipeline stage, loaded.

    The model is built on the meta device, sharded by the plan and pruned to the stage there
    (shapes only, no data), then materialised on the CPU; each kept parameter then reads only
    its own slice of the checkpoint (load_hf_weights), so no rank ever holds the full model.
    num_labels: classifier outputs (classification families); ignored by causal LMs.
    stage: (layers, first, last) of a pipeline stage (galaxy.pipeline.stage.keep_stage); None
    keeps the whole model.
    task: "classification" | "causal_lm"; None: the family's first (primary) task.
    plan: its sub-block methods (apply_plan) and the layers that recompute in backward (its
    checkpoint: resolved layer indices, or as a config writes it).
    """
    cfg = load_hf_config(model_path, dropout)
    family = family_of(cfg.model_type)
    device = torch.device(device)
    with LazyCheckpoint(model_path) as checkpoint:
        cfg = tie_as_checkpoint(cfg, checkpoint, family)
        with torch.device("meta"):
            model = model_class(family, task)(cfg, num_labels=num_labels)
        apply_plan(model, plan, group, ShardedRNG(seed, group.rank, device))
        for i in recompute_layers(plan.checkpoint, len(model.layers)):
            model.layers[i].set_recompute(True, model.attached.sharded_rng)
        # The whole model against the checkpoint's headers (no data) before pruning: a bad
        # checkpoint fails alike on every pipeline stage, with the first error the full model meets.
        locate_weights(model, checkpoint, family, group.rank)
        if stage is not None:
            keep_stage(model, *stage)
        model.to_empty(device="cpu")      # new, uninitialised tensors: ties are broken, buffers empty
        model.materialize()      # non-checkpoint state: rotary tables, tied weights
        load_hf_weights(model, checkpoint, family, seed, group.rank)
    return model.to(device)
