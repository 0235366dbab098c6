"""Build this rank's part of the model (a pipeline stage, or a Galaxy replica) and the runner that fits
any mesh."""
from __future__ import annotations

from contextlib import nullcontext

from galaxy.models.build import load_hf_config
from galaxy.runtime.assemble import build_model
from galaxy.parallel.data_parallel import DataParallelRunner
from galaxy.pipeline.runner import PipelineRunner
from galaxy.pipeline.split import stage_layer_ranges


def set_overlap(model, comm_chunks: int = 1, kv_blocks: bool = False) -> None:
    """How every layer overlaps its communication with compute (the config keys of these names):
    a TP ATT's and MLP's transitions travel in `comm_chunks` chunks of the sequence (1: one
    collective per transition, galaxy.layers.block); with `kv_blocks` an SP ATT attends to its own
    keys while the K/V all-gather travels (galaxy.layers.attention.attention_while_gathering)."""
    for layer in model.layers:
        layer.set_overlap(comm_chunks, kv_blocks)


def build_pipeline(model_path: str, plan, mesh, *, num_labels: int | None = None, seed: int = 0,
                   device="cpu", dropout: float | None = None,
                   stage_num_hidden_layers_list: list[int] | None = None, num_microbatches: int = 1,
                   schedule: str = "1f1b", autocast=nullcontext, adapt=None,
                   activation_checkpointing="none", task: str | None = None,
                   dp_sharding: str = "none", comm_chunks: int = 1, kv_blocks: bool = False) -> PipelineRunner:
    """This rank's stage (mesh.pp_rank) of the model under `plan`, in a PipelineRunner.

    build_model prunes the model to the stage before any weight is read, so the rank reads and
    holds only its stage's share. adapt(model), when given, changes the stage before anything
    wraps it (e.g. apply_peft).
    """
    layers = load_hf_config(model_path).num_hidden_layers
    ranges = stage_layer_ranges(layers, mesh.pp_size, stage_num_hidden_layers_list)
    model = build_model(model_path, plan, mesh.galaxy, num_labels=num_labels, seed=seed, device=device,
                        dropout=dropout, stage=(ranges[mesh.pp_rank], mesh.is_first_stage, mesh.is_last_stage),
                        activation_checkpointing=activation_checkpointing, task=task)
    set_overlap(model, comm_chunks, kv_blocks)
    if adapt is not None:
        adapt(model)
    return PipelineRunner(model, plan, mesh, num_microbatches=num_microbatches, schedule=schedule,
                          device=device, autocast=autocast, dp_sharding=dp_sharding)


def build_runner(model_path: str, plan, mesh, *, num_labels: int | None = None, seed: int = 0,
                 device="cpu", dropout: float | None = None,
                 stage_num_hidden_layers_list: list[int] | None = None, num_microbatches: int = 1,
                 schedule: str = "1f1b", grad_accum_steps: int = 1, autocast=nullcontext, adapt=None,
                 activation_checkpointing="none", task: str | None = None, dp_sharding: str = "none",
                 comm_chunks: int = 1, kv_blocks: bool = False):
    """A PipelineRunner when mesh.pp_size > 1, else a DataParallelRunner (dp 1: plain Galaxy).

    num_microbatches / schedule / stage_num_hidden_layers_list apply to pipelines, grad_accum_steps
    to the rest (a pipeline's micro-batches are its accumulation). adapt(model), when given, changes
    the model (or stage) after it is built and before DDP / gradient sync wrap it.
    activation_checkpointing: the layers that recompute in backward (galaxy.runtime.assemble).
    task: the model's task (build_model's; None: the family's primary one).
    dp_sharding: "none" (DDP over the replicas), "full" or "no_reshard" (FSDP2 over them,
    galaxy.parallel.sharded_dp); no effect with one replica.
    comm_chunks, kv_blocks: how the layers overlap communication with compute (set_overlap).
    """
    if mesh.pp_size > 1:
        return build_pipeline(model_path, plan, mesh, num_labels=num_labels, seed=seed, device=device,
                              dropout=dropout, stage_num_hidden_layers_list=stage_num_hidden_layers_list,
                              num_microbatches=num_microbatches, schedule=schedule, autocast=autocast,
                              adapt=adapt, activation_checkpointing=activation_checkpointing, task=task,
                              dp_sharding=dp_sharding, comm_chunks=comm_chunks, kv_blocks=kv_blocks)
    model = build_model(model_path, plan, mesh.galaxy, num_labels=num_labels, seed=seed, device=device,
                        dropout=dropout, activation_checkpointing=activation_checkpointing, task=task)
    set_overlap(model, comm_chunks, kv_blocks)
    if adapt is not None:
        adapt(model)
    runner = DataParallelRunner(model, mesh, grad_accum_steps=grad_accum_steps, device=device, autocast=autocast,
                                dp_sharding=dp_sharding)
    if mesh.dp_pg is not None:
        # DDP writes its average back into .grad after backward, and FSDP replaces .grad with its
        # reduce-scattered shard, so the Galaxy group's sums cannot start during backward
        # (galaxy.parallel.grad_sync would notice and redo them).
        runner.sync.overlap = False
    return runner
