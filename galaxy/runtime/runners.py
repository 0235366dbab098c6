"""Build this rank's part of the model (a pipeline stage, or a Galaxy replica) and the runner that fits
any mesh, from one resolved galaxy.plan.Plan."""
from __future__ import annotations

from contextlib import nullcontext
from datetime import timedelta

from galaxy.config import resolved_plan
from galaxy.distributed.mesh import make_mesh
from galaxy.parallel.data_parallel import DataParallelRunner
from galaxy.parallel.embedding_grad import accumulate_rows_in_place
from galaxy.plan import Plan
from galaxy.runtime.assemble import build_model


def plan_and_mesh(cfg, world: int, shape: dict):
    """A run's resolved plan on `world` processes and its mesh (every process group built, bounded
    by the config's timeout_s: collective)."""
    plan = resolved_plan(cfg, world, shape)
    return plan, make_mesh(plan, timeout=timedelta(seconds=cfg.timeout_s))


def stage_of(plan: Plan, mesh) -> tuple[range, bool, bool] | None:
    """This rank's pipeline stage as build_model takes it: (layers, first, last); None without one."""
    if plan.pp == 1:
        return None
    return plan.stage_layers()[mesh.pp_rank], mesh.is_first_stage, mesh.is_last_stage


def build_runner(model_path: str, plan: Plan, mesh, *, num_labels: int | None = None, seed: int = 0,
                 device="cpu", dropout: float | None = None, autocast=nullcontext, adapt=None,
                 task: str | None = None):
    """This rank's model under the resolved `plan`, in a PipelineRunner when plan.pp > 1 (this
    rank's stage, mesh.pp_rank) else a DataParallelRunner (dp 1: plain Galaxy).

    build_model prunes the model to the stage before any weight is read, so a rank reads and holds
    only its stage's share. adapt(model), when given, changes the model (or stage) after it is built
    and before DDP / FSDP / gradient sync wrap it (e.g. apply_peft). task: the model's task
    (build_model's; None: the family's primary one).
    """
    model = build_model(model_path, plan, mesh.galaxy, num_labels=num_labels, seed=seed, device=device,
                        dropout=dropout, stage=stage_of(plan, mesh), task=task)
    if adapt is not None:
        adapt(model)
    if plan.pp > 1:
        # Imported here: torch.distributed.pipelining's import costs about as much as torch's.
        from galaxy.pipeline.runner import PipelineRunner
        runner = PipelineRunner(model, plan, mesh, device=device, autocast=autocast)
    else:
        runner = DataParallelRunner(model, plan, mesh, device=device, autocast=autocast)
    # After DDP wraps the model (galaxy.parallel.embedding_grad): micro-batches add the word
    # embedding's rows into its .grad in place.
    accumulate_rows_in_place(model, plan, runner.sharding != "none")
    if plan.pp == 1 and mesh.dp_pg is not None:
        # DDP writes its average back into .grad after backward, and FSDP replaces .grad with its
        # reduce-scattered shard, so the Galaxy group's sums cannot start during backward
        # (galaxy.parallel.grad_sync would notice and redo them).
        runner.sync.overlap = False
    return runner
