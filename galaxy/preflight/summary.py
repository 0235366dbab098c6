"""--check's one paragraph: what the run would do, from the checked config, job and model."""
from __future__ import annotations

from galaxy.config import resolved_plan
from galaxy.models.shape import read_model_shape


def _plan(cfg, world: int) -> str:
    if world == 1:
        return "serially on 1 process"
    plan = resolved_plan(cfg, world, read_model_shape(cfg.model_path))
    sharded = f" (replicas sharded: {plan.dp_sharding})" if plan.dp_sharding != "none" else ""
    text = (f"plan ATT {plan.att} / CON {plan.con} / MLP {plan.mlp} on world {world} = pp {plan.pp} x "
            f"dp {plan.dp}{sharded} x Galaxy group {plan.group}")
    shares = [f"{what} {list(getattr(plan, name))}" for name, what in
              (("heads", "heads"), ("columns", "MLP columns"), ("tokens", "tokens"))
              if getattr(plan, name) and plan.group > 1]
    if plan.replica_rows is not None:
        shares.append(f"rows per replica {list(plan.replica_rows)}")
    return text + (f" ({', '.join(shares)})" if shares else "")


def _model(report) -> str:
    m = report.model
    return f"{m.model_type} ({m.layers} layers, hidden {m.hidden_size}, {m.parameters:,} parameters) from {m.source}"


def summary(cfg, job, report, script: str, rank: int, world: int) -> str:
    """One paragraph; ends by saying that nothing ran."""
    placed = "" if cfg.mesh_rank_order is None else f", mesh position {cfg.plan.position_of(rank)}"
    who = f"{script} (rank {rank} of {world}{placed})" if world > 1 else script
    parts = []
    if report.model is None:                       # a script that builds no model (tests' launch target)
        parts.append(f"{who} would start {_plan(cfg, world)} with model_path {cfg.model_path}")
    elif getattr(job, "what", None) is not None:     # an inference job says what it would do
        parts.append(f"{who} would {job.what} with {_model(report)}, {_plan(cfg, world)}")
    elif getattr(job, "task", None) is None:
        parts.append(f"{who} would profile one training step of {_model(report)} on a batch of "
                     f"{cfg.batch_size} x {cfg.pad_size} tokens, {_plan(cfg, world)}")
    else:
        task = job.task
        data = f"{len(task.train_set):,} training examples"
        if task.class_names:
            data += f" in {len(task.class_names)} classes"
        held = [f"{name} {len(s):,}" for name, s in (("dev", task.dev_set), ("test", task.test_set)) if s]
        data += f" ({', '.join(held)} held out)" if held else ""
        schedule = cfg.lr_schedule + (f", {cfg.warmup_steps} warm-up steps" if cfg.warmup_steps else "")
        method = job.peft.method if job.peft.method != "full" else "full fine-tuning"
        parts.append(f"{who} would train {_model(report)} on {data}: {report.steps} steps of global batch "
                     f"{cfg.batch_size} x {cfg.pad_size} tokens, {cfg.optimizer} at learning rate "
                     f"{cfg.learning_rate:g} ({schedule}), {method}, {_plan(cfg, world)}")
        if report.model.new_head:
            parts.append(f"a new classifier of {task.num_labels} outputs is initialised")
    if getattr(job, "resume", None) is not None:
        parts.append(f"resuming from {job.resume.path} (step {job.resume.step})")
    for key, what in (("save_dir", "checkpoints go to"), ("export_dir", "the model is exported to"),
                      ("metrics_file", "metrics go to")):
        if getattr(cfg, key, None):
            parts.append(f"{what} {getattr(cfg, key)}")
    return "check: " + "; ".join(parts) + ". Every check passed; nothing was run (no process group, no files written)."
