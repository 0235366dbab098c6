"""The shared training loop of every classification entry script.

prepare_classifier runs before any process group starts (so a bad data file or checkpoint is a
one-line exit 2); train_classifier builds the mesh and the model under the config's plan, restores
a checkpoint if asked, trains, evaluates, saves, exports and reports.

Per optimizer step k (1-based): one global batch of batch_size examples, in grad_accum_steps
micro-batches (galaxy/train/step.py) -> gradient sync -> optional clipping -> lr of step k ->
update. After step k: the metrics line, the dev evaluation every eval_interval steps, a checkpoint
every save_interval steps. At the end: dev and test evaluation, a last checkpoint, the Hugging Face
export, the summary, the plot.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tqdm import tqdm

from galaxy.config import ConfigError, read_model_shape
from galaxy.data import ClassificationBatches, load_examples
from galaxy.distributed.mesh import build_mesh
from galaxy.models.build import CheckpointError, build_model
from galaxy.parallel.grad_sync import GradientSync
from galaxy.parallel.plan import ParallelPlan
from galaxy.train.checkpoint import Checkpoint, resolve_resume, save_checkpoint
from galaxy.train.evaluate import evaluate
from galaxy.train.export import export_hf
from galaxy.train.metrics import MetricsWriter
from galaxy.train.optim import make_optimizer
from galaxy.train.optim_state import load_optimizer_state
from galaxy.train.rng_state import restore_rng
from galaxy.train.schedule import LRSchedule
from galaxy.train.step import OptimizerStep, autocast_for
from galaxy.train.summary import format_summary, gather_peak_memory


@dataclass
class ClassifierJob:
    cfg: object
    tokenizer: object
    train_set: list
    dev_set: list | None
    test_set: list | None
    class_names: list[str]
    shape: dict
    resume: Checkpoint | None = None


def _held_out(cfg, path, split, class_names):
    """A dev/test set: the given file, or the embedded dataset's split when training on it."""
    if path is None and cfg.train_path is not None:
        return None
    return load_examples(path, split, class_names)[0]


def check_resumable(ckpt: Checkpoint, cfg, class_names: list[str], train_examples: int) -> None:
    """What must not change across a resume for the data position and state to mean the same."""
    state = ckpt.state
    for what, saved, now, fix in (
            ("class names", state["class_names"], class_names, "class_list / the data's labels"),
            ("batch_size", state["batch_size"], cfg.batch_size, "batch_size"),
            ("number of training examples", state["train_examples"], train_examples, "train_path"),
            ("optimizer", state["optimizer"], cfg.optimizer, "optimizer")):
        if saved != now:
            raise CheckpointError(f"checkpoint {ckpt.path} was trained with {what} {saved!r}, the "
                                  f"config gives {now!r}; set {fix} as it was, or start afresh")


def prepare_classifier(cfg) -> ClassifierJob:
    from transformers import AutoTokenizer
    if cfg.pp_deg > 1 or cfg.dp_deg > 1:
        raise ConfigError("pp_deg and dp_deg > 1 are not supported by the classification trainer yet; "
                          "set them to 1")
    shape = read_model_shape(cfg.model_path)
    if shape["model_type"] != "bert":
        raise ConfigError(f"model_path holds a {shape['model_type']!r} model; the classification "
                          "scripts train BERT models")
    train_set, class_names = load_examples(cfg.train_path, "train", cfg.class_list)
    dev_set = _held_out(cfg, cfg.dev_path, "dev", class_names)
    test_set = _held_out(cfg, cfg.test_path, "test", class_names)
    if len(train_set) < cfg.batch_size:
        raise ConfigError(f"batch_size {cfg.batch_size} is larger than the {len(train_set)} training "
                          "examples; lower batch_size")
    resume = resolve_resume(cfg.resume, cfg.save_dir)
    if resume is not None:
        check_resumable(resume, cfg, class_names, len(train_set))
    tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
    return ClassifierJob(cfg, tokenizer, train_set, dev_set, test_set, class_names, shape, resume)


def plan_of(cfg) -> ParallelPlan:
    return ParallelPlan(cfg.att_parallel_method, cfg.mlp_parallel_method, cfg.con_parallel_method)


class ClassifierTrainer:
    def __init__(self, job: ClassifierJob, env):
        cfg = self.cfg = job.cfg
        self.job, self.env, self.lead = job, env, env.rank == 0
        torch.manual_seed(cfg.seed)     # identical on every rank: replicated draws stay in lockstep
        mesh = build_mesh(cfg, env.rank, env.world, job.shape)
        self.group = mesh.galaxy
        source = job.resume.model_dir if job.resume else cfg.model_path
        self.model = build_model(source, plan_of(cfg), mesh.galaxy, num_labels=len(job.class_names),
                                 seed=cfg.seed, device=env.device, dropout=cfg.dropout)
        self.model.train()
        self.optimizer = make_optimizer(cfg, self.model.parameters())
        self.batches = ClassificationBatches(job.train_set, job.tokenizer, cfg.pad_size, cfg.batch_size,
                                             cfg.shuffle, cfg.seed)
        self.total = len(self.batches) * cfg.num_epochs
        if cfg.max_steps is not None:
            self.total = min(self.total, cfg.max_steps)
        self.schedule = LRSchedule(cfg.lr_schedule, cfg.learning_rate, cfg.warmup_steps, self.total)
        self.autocast = autocast_for(cfg.mixed_precision, env.device)
        self.train_step = OptimizerStep(self.model, self.optimizer, GradientSync(self.model, self.group.pg),
                                        self.schedule, grad_accum_steps=cfg.grad_accum_steps,
                                        clip_grad=cfg.clip_grad, autocast=self.autocast)
        self.step, self.tokens_seen = 0, 0
        self.saved_step = None          # the step of the newest checkpoint this run saved or resumed from
        self.notes: list[str] = []
        if job.resume is not None:
            self._restore(job.resume)
        elif cfg.resume == "latest":
            self.notes.append(f"resume: no checkpoint in {cfg.save_dir} yet, starting from step 0")

    # --- checkpoint state -------------------------------------------------------------------

    def layout(self) -> dict:
        """What the per-rank (sharded) random streams depend on."""
        g, plan = self.group, plan_of(self.cfg)
        return {"world": self.env.world, "plan": [plan.att, plan.mlp, plan.con],
                "heads": list(g.heads), "intermediate": list(g.intermediate), "seq": list(g.seq),
                "device": self.env.device.type}

    def trainer_state(self) -> dict:
        return {"tokens_seen": self.tokens_seen, "data": self.batches.state_dict(),
                "schedule": self.schedule.state_dict(), "optimizer": self.cfg.optimizer,
                "layout": self.layout(), "class_names": self.job.class_names,
                "batch_size": self.cfg.batch_size, "train_examples": len(self.job.train_set)}

    def _restore(self, ckpt: Checkpoint) -> None:
        state = ckpt.state
        load_optimizer_state(self.model, self.optimizer, ckpt.optimizer_tensors(), state["optimizer_groups"])
        self.batches.load_state_dict(state["data"])
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        self.saved_step = self.step
        restore_rng(self.model, self.env.device, ckpt.rng_tensors(), same_layout=state["layout"] == self.layout(),
                    seed=self.cfg.seed, step=self.step)
        if state["schedule"] != self.schedule.state_dict():
            self.notes.append(f"resume: the learning-rate schedule {state['schedule']} of the checkpoint "
                              f"differs from the config's {self.schedule.state_dict()}; using the config's")
        self.notes.append(f"resume: continuing from {ckpt.path} at step {self.step}")

    def save(self) -> None:
        cfg = self.cfg
        path = save_checkpoint(cfg.save_dir, self.step, model=self.model, optimizer=self.optimizer,
                               trainer_state=self.trainer_state(), base_model_path=cfg.model_path,
                               class_names=self.job.class_names, tokenizer=self.job.tokenizer,
                               device=self.env.device, lead=self.lead, keep=cfg.keep_checkpoints)
        self.saved_step = self.step
        self._note(f"checkpoint: {path}")

    # --- evaluation ---------------------------------------------------------------------------

    def evaluate(self, examples) -> dict:
        return evaluate(self.model, examples, self.job.tokenizer, self.cfg.pad_size, self.cfg.batch_size,
                        self.env.device, self.autocast)

    def _log_evaluation(self, metrics, event: str, examples) -> dict | None:
        """Evaluate a held-out set (None: no such set) and log it as {"event": event, "step", ...}."""
        if not examples:
            return None
        result = self.evaluate(examples)
        metrics.log_event(event, step=self.step, **result)
        return result

    def _note(self, text: str) -> None:
        if self.lead:
            tqdm.write(text)

    # --- the loop -----------------------------------------------------------------------------

    def fit(self) -> dict:
        cfg, env, job = self.cfg, self.env, self.job
        metrics = MetricsWriter(cfg.metrics_file, enabled=self.lead)
        metrics.log_event("start", step=self.step, resumed_from=job.resume.path if job.resume else None,
                          world=env.world, plan=self.layout()["plan"])
        for note in self.notes:
            self._note(note)
        first_step, start = self.step, time.perf_counter()
        loss_value, run_tokens, train_time = self._train(metrics)
        summary = {"steps": self.step, "steps_this_run": self.step - first_step, "tokens": run_tokens,
                   "tokens_per_s": round(run_tokens / train_time, 1) if train_time else 0.0,
                   "final_loss": loss_value}
        for split, event, examples in (("dev", "eval", job.dev_set), ("test", "test", job.test_set)):
            result = self._log_evaluation(metrics, event, examples)
            if result is not None:
                summary.update({f"{split}_loss": result["loss"], f"{split}_accuracy": result["accuracy"]})
        if cfg.save_dir and self.saved_step != self.step:
            self.save()
        if cfg.export_dir:
            export_hf(self.model, cfg.export_dir, base_model_path=cfg.model_path, class_names=job.class_names,
                      tokenizer=job.tokenizer, lead=self.lead)
            self._note(f"export: {cfg.export_dir}")
        summary["wall_s"] = round(time.perf_counter() - start, 3)
        summary["peak_memory_mib"] = gather_peak_memory(env.device)
        metrics.log_event("done", **summary)
        metrics.close()
        if self.lead:
            print(format_summary(summary, env.device), flush=True)
            self._plot()
        dist.barrier()
        return summary

    def _train(self, metrics) -> tuple[float, int, float]:
        """Steps up to self.total, with the periodic evaluations and checkpoints.

        Returns (last loss, non-padding tokens trained on, seconds spent in training steps).
        """
        cfg, device = self.cfg, self.env.device
        loss_value, run_tokens, train_time, dev_acc = math.nan, 0, 0.0, "-"
        bar = tqdm(total=self.total, initial=self.step, disable=not self.lead, desc="train", unit="step",
                   dynamic_ncols=True)
        while self.step < self.total:
            for batch in self.batches:                 # resumes at the saved data position
                t0 = time.perf_counter()
                batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
                loss, norm = self.train_step(batch, self.step + 1)
                loss_value = loss.item()               # the global-batch mean, the same on every rank
                if not math.isfinite(loss_value):
                    raise FloatingPointError(f"loss became {loss_value} at step {self.step + 1}")
                self.step += 1
                tokens = int(batch["attention_mask"].sum())
                dt = time.perf_counter() - t0
                run_tokens, train_time = run_tokens + tokens, train_time + dt
                self.tokens_seen += tokens
                extra = {} if norm is None else {"grad_norm": norm.item()}
                metrics.log_step(self.step, loss_value, self.optimizer.param_groups[0]["lr"], tokens, dt, **extra)
                # The final evaluation and save happen after the loop, once.
                if cfg.eval_interval and self.step % cfg.eval_interval == 0 and self.step < self.total:
                    dev = self._log_evaluation(metrics, "eval", self.job.dev_set)
                    dev_acc = f"{dev['accuracy']:.3f}" if dev else "-"
                if cfg.save_dir and cfg.save_interval and self.step % cfg.save_interval == 0:
                    self.save()
                bar.update(1)
                bar.set_postfix(loss=f"{loss_value:.4f}", tok_s=f"{run_tokens / train_time:.0f}", dev_acc=dev_acc)
                if self.step >= self.total:
                    break
        bar.close()
        return loss_value, run_tokens, train_time

    def _plot(self) -> None:
        if not self.cfg.metrics_file:
            return
        try:
            from galaxy.train.plot import plot_metrics
            print(f"plot: {plot_metrics(self.cfg.metrics_file, chance=1 / len(self.job.class_names))}")
        except ImportError:
            print("plot: skipped (matplotlib is not installed; pip install -e '.[demo]')")


def train_classifier(job: ClassifierJob, env) -> dict:
    return ClassifierTrainer(job, env).fit()
