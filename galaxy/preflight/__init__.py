"""Everything a run needs, checked before any process group starts (galaxy.launch calls this).

    check_output_paths(cfg)       save_dir, export_dir, metrics_file can be written (paths.py)
    check_job(cfg, job) -> Report the weights against config.json and the task's classes, the
                                  resume checkpoint against model_path, LoRA's targets against
                                  the model, and the step count against warmup_steps
    summary(...)                  what would run, for --check (summary.py)

The tokenizer is checked where it is loaded (tokenizer.py), the config, data and plan by
galaxy.config and the jobs' prepare functions, checkpoints' integrity by galaxy.train.manifest.
Every problem is a ConfigError: one line naming the key or file and the fix, exit status 2.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from galaxy.config import ConfigError
from galaxy.models.shape import with_shape_keys
from galaxy.preflight.paths import check_output_paths
from galaxy.preflight.tokenizer import check_tokenizer_files, load_tokenizer
from galaxy.preflight.weights import ModelFacts, check_weights, read_config_json

__all__ = ["Report", "check_job", "check_output_paths", "check_tokenizer_files", "load_tokenizer",
           "training_steps"]

# config.json keys that must agree between model_path and a checkpoint resumed on top of it.
SHAPE_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "intermediate_size", "vocab_size", "max_position_embeddings")


@dataclass
class Report:
    model: ModelFacts | None = None
    steps: int | None = None                     # optimizer steps the run would train (training jobs)
    warnings: list[str] = field(default_factory=list)


def training_steps(cfg, train_examples: int) -> int:
    """The trainer's step count: whole global batches per epoch x epochs, capped by max_steps."""
    total = train_examples // cfg.batch_size * cfg.num_epochs
    return total if cfg.max_steps is None else min(total, cfg.max_steps)


def check_job(cfg, job) -> Report:
    """The checks that need what the job's prepare function read (data, classes, checkpoint)."""
    report = Report()
    resume = getattr(job, "resume", None)
    if resume is not None:
        check_resume_fits(resume, cfg.model_path)
        report.warnings.extend(resume.notes)      # damaged newer checkpoints that "latest" skipped
    task = getattr(job, "task", None)
    num_labels = task.num_labels if task is not None else getattr(job, "num_labels", None)
    source, what = (resume.model_dir, f"resume checkpoint {resume.path!r}: model/") if resume else \
        (cfg.model_path, "model_path")
    # Only the trainer re-initialises a classifier (galaxy.train.head), and never a resumed one.
    reinit = bool(cfg.ignore_mismatched_sizes) and task is not None and resume is None
    report.model, model = check_weights(source, what, num_labels, reinit_head=reinit, reinit_hint=task is not None,
                                        task=getattr(task, "kind", None))
    peft = getattr(job, "peft", None)
    if peft is not None and peft.method == "lora":
        check_lora_targets(cfg, peft, model)
    if task is not None:
        report.steps = training_steps(cfg, len(task.train_set))
        if report.steps < 1:
            raise ConfigError(f"the run would train 0 steps ({len(task.train_set)} examples, batch_size "
                              f"{cfg.batch_size}); lower batch_size or add data")
        if cfg.warmup_steps > report.steps:
            peak = cfg.learning_rate * report.steps / cfg.warmup_steps
            report.warnings.append(
                f"warning: warmup_steps {cfg.warmup_steps} is more than the {report.steps} steps this run trains, "
                f"so the learning rate never reaches learning_rate {cfg.learning_rate:g} (it ends at {peak:.3g}); "
                f"lower warmup_steps to at most {report.steps}")
        if report.model.head_rows is not None and report.model.head_rows != num_labels:
            report.warnings.append(
                f"note: ignore_mismatched_sizes: the classifier of {source} has {report.model.head_rows} outputs; "
                f"a new one with {num_labels} outputs is initialised (seed {cfg.seed})")
    return report


def check_resume_fits(resume, model_path: str) -> None:
    """A checkpoint resumes on top of model_path's config (splits, mesh): their shapes must agree."""
    # with_shape_keys: a family's own names for the sizes (GPT-2's n_embd, ...) under the standard ones.
    saved = with_shape_keys(read_config_json(resume.model_dir), os.path.join(resume.model_dir, "config.json"))
    base = with_shape_keys(read_config_json(model_path), os.path.join(model_path, "config.json"))
    for key in SHAPE_KEYS:
        if saved.get(key) != base.get(key):
            raise ConfigError(f"resume checkpoint {resume.path!r} holds a model with {key} {saved.get(key)!r} but "
                              f"model_path {model_path!r} has {base.get(key)!r}; resume from a checkpoint of this "
                              "model, or remove resume to start afresh")


def check_lora_targets(cfg, peft, model) -> None:
    """The projections lora_target_modules (or lora_path's targets) select, on the meta model."""
    from torch import nn

    from galaxy.layers.linear import OutputProjection
    from galaxy.models.registry import family_of
    from galaxy.peft.lora import find_targets
    from galaxy.peft.peft_format import read_lora_dir
    family = family_of(model.config.model_type)
    to_hf = family.hf_names(model.config)
    key, targets = "lora_target_modules", peft.lora_target_modules or family.lora_targets
    if peft.lora_path:
        try:
            spec = read_lora_dir(peft.lora_path, family.lora_fan_in_fan_out)[0]   # GPT-2's Conv1D: fan_in_fan_out
            key, targets = f"lora_path {peft.lora_path!r}'s target_modules", spec.target_modules
        except (OSError, ValueError, KeyError) as e:
            raise ConfigError(f"lora_path {peft.lora_path!r}: {' '.join(str(e).split())[:200]}") from None
    try:
        find_targets(model, targets, to_hf)
    except ValueError as e:
        if "output head" in str(e):
            raise ConfigError(str(e)) from None
        names = sorted({to_hf(f"{n}.weight").removesuffix(".weight").rsplit(".", 1)[-1]
                        for n, m in model.named_modules()
                        if type(m) in (nn.Linear, OutputProjection) and n not in model.output_heads})
        shown = list(targets) if not isinstance(targets, str) else targets
        raise ConfigError(f"{key} {shown!r} names no projection of this {family.name} model; its projections "
                          f"are {', '.join(names)} (Hugging Face module names)") from None
