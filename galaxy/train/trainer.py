"""The shared training loop of every entry script: one trainer, any task, any mesh.

prepare_classifier / prepare_causal_lm run before any process group starts (so a bad data file or
checkpoint is a one-line exit 2); Trainer builds the mesh (pp x dp x Galaxy group), the runner
(galaxy.runtime.runners.build_runner: a pipeline of Galaxy-group stages when pp_deg > 1, else Galaxy
replicas under DDP) and trains; the task (galaxy/train/tasks.py) brings data and evaluation.

Per optimizer step k (1-based): one global batch of batch_size rows (each data-parallel replica
reads only its rows: batch_size / dp_deg, or its dp_batch_list entry), forward and backward in
grad_accum_steps micro-batches (or num_microbatches pipeline micro-batches), gradient sync (Galaxy "sum" rule, DP average) ->
optional clipping -> lr of step k -> update. After step k: the metrics line, the dev evaluation
every eval_interval steps, a checkpoint every save_interval steps. At the end: dev and test
evaluation, a last checkpoint, the Hugging Face export, the summary, the plot. Checkpoints and
exports of a pipeline gather every stage to rank 0 and read the same as pp_deg 1 ones
(galaxy/pipeline/stage_state.py); each stage's dropout streams are its own (rng_state.py).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tqdm import tqdm

from galaxy.distributed import waiting
from galaxy.config import ConfigError
from galaxy.models.shape import read_model_shape
from galaxy.models.build import CheckpointError
from galaxy.models.registry import families_for
from galaxy.models.weights import read_hf_state_dict
from galaxy.parallel.loss_scale import riding_with_the_loss
from galaxy.peft import PeftOptions, apply_peft, export_peft, parameter_counts, peft_summary
from galaxy.runtime.runners import build_runner, plan_and_mesh
from galaxy.pipeline.stage_state import agree_on_load
from galaxy.preflight.tokenizer import load_tokenizer
from galaxy.train.checkpoint import Checkpoint, resolve_resume, save_checkpoint
from galaxy.runtime.export import export_hf
from galaxy.train.head import checkpoint_head_rows, replace_classifier
from galaxy.train.layout import layout_record, saved_layout
from galaxy.train.metrics import MetricsWriter
from galaxy.train.optim import make_optimizer
from galaxy.train.optim_state import load_optimizer_state
from galaxy.train.rng_state import restore_rng, seed_streams
from galaxy.train.schedule import LRSchedule
from galaxy.train.step import autocast_for
from galaxy.train.summary import format_summary, gather_peak_memory
from galaxy.train.tasks import CausalLMTask, ClassificationTask, Seq2SeqTask

SCRIPTS = {"classification": "sequence classification (pretrain_*_bert.py; task: classification)",
           "causal_lm": "causal-LM training (finetune_llama.py; task: causal_lm)",
           "seq2seq": "sequence-to-sequence training (finetune_bart.py, finetune_t5.py; task: seq2seq)"}
TASKS = {"classification": ClassificationTask, "causal_lm": CausalLMTask, "seq2seq": Seq2SeqTask}


@dataclass
class Job:
    cfg: object
    task: object              # ClassificationTask | CausalLMTask | Seq2SeqTask
    tokenizer: object
    shape: dict
    resume: Checkpoint | None = None
    peft: PeftOptions = PeftOptions()


def check_resumable(ckpt: Checkpoint, cfg, task) -> None:
    """What must not change across a resume for the data position and state to mean the same."""
    state, now = ckpt.state, task.identity()
    for what, saved, given, fix in (
            ("class names", state["class_names"], now["class_names"], "class_list / the data's labels"),
            ("batch_size", state["batch_size"], cfg.batch_size, "batch_size"),
            ("number of training examples", state["train_examples"], now["train_examples"], "train_path"),
            ("optimizer", state["optimizer"], cfg.optimizer, "optimizer")):
        if saved != given:
            raise CheckpointError(f"checkpoint {ckpt.path} was trained with {what} {saved!r}, the "
                                  f"config gives {given!r}; set {fix} as it was, or start afresh")


def _prepare(cfg, kind: str) -> Job:
    """kind: the entry script's task, unless the config's `task` key names another."""
    kind = cfg.task or kind
    shape = read_model_shape(cfg.model_path)
    check_task(shape["model_type"], kind)
    try:
        peft = PeftOptions.from_config(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    tokenizer = load_tokenizer(cfg.model_path)
    if kind == "classification" and tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token   # a decoder's tokenizer often has none; rows pad right
    task = TASKS[kind](cfg, tokenizer)
    if len(task.train_set) < cfg.batch_size:
        raise ConfigError(f"batch_size {cfg.batch_size} is larger than the {len(task.train_set)} training "
                          "examples; lower batch_size")
    resume = resolve_resume(cfg.resume, cfg.save_dir)
    if resume is not None:
        check_resumable(resume, cfg, task)
    return Job(cfg, task, tokenizer, shape, resume, peft)


def check_task(model_type: str, kind: str) -> None:
    """A one-line error unless the family of `model_type` does task `kind`."""
    able = [t for spec in families_for(kind) for t in spec.model_types]
    if model_type not in able:
        raise ConfigError(f"model_path holds a {model_type!r} model; {SCRIPTS[kind]} trains "
                          f"{', '.join(sorted(able))} models")


def prepare_classifier(cfg) -> Job:
    return _prepare(cfg, "classification")


def prepare_causal_lm(cfg) -> Job:
    return _prepare(cfg, "causal_lm")


def prepare_seq2seq(cfg) -> Job:
    return _prepare(cfg, "seq2seq")


class Trainer:
    def __init__(self, job: Job, env):
        cfg = self.cfg = job.cfg
        self.job, self.task, self.env, self.lead = job, job.task, env, env.rank == 0
        torch.manual_seed(cfg.seed)     # identical on every rank while the model is built
        self.plan, self.mesh = plan, mesh = plan_and_mesh(cfg, env.world, job.shape)
        self.group = mesh.galaxy
        self.autocast = autocast_for(cfg.mixed_precision, env.device)
        source = job.resume.model_dir if job.resume else cfg.model_path
        self.peft = job.peft
        # PEFT weights resume from the checkpoint's folder (its weights hold them under HF names).
        peft_state = read_hf_state_dict(source) if job.resume and self.peft.method != "full" else None

        # ignore_mismatched_sizes: build with the checkpoint's head (so that it loads), then replace it.
        num_labels = build_labels = self.task.num_labels
        if cfg.ignore_mismatched_sizes and num_labels is not None and job.resume is None:
            build_labels = checkpoint_head_rows(source) or num_labels

        def adapt(model):   # after the model (or stage) is built, before DDP / gradient sync wrap it
            if build_labels != num_labels:
                replace_classifier(model, num_labels, cfg.seed)
            apply_peft(model, self.peft, seed=cfg.seed, state=peft_state)

        self.runner = build_runner(source, plan, mesh, num_labels=build_labels, seed=cfg.seed, device=env.device,
                                   dropout=cfg.dropout, autocast=self.autocast, adapt=adapt, task=self.task.kind)
        self.model = self.runner.model   # this rank's part: a Galaxy shard (of one pipeline stage)
        # Dropout streams per pipeline stage, in lockstep within it (galaxy/train/rng_state.py);
        # after the build, so that what building drew does not matter.
        seed_streams(self.model, cfg.seed, mesh.pp_rank, env.device)
        self.runner.train()
        self.optimizer = make_optimizer(cfg, self.runner.parameters())
        # Every stage of a replica reads that replica's rows (the first stage needs the tokens,
        # the last the labels, all of them the mask); no rank reads another replica's rows.
        self.batches = self.task.batches(shard=(mesh.dp_rank, plan.replica_rows or mesh.dp_size))
        self.total = len(self.batches) * cfg.num_epochs
        if cfg.max_steps is not None:
            self.total = min(self.total, cfg.max_steps)
        self.schedule = LRSchedule(cfg.lr_schedule, cfg.learning_rate, cfg.warmup_steps, self.total)
        self.step, self.tokens_seen = 0, 0
        self.saved_step = None          # the step of the newest checkpoint this run saved or resumed from
        self.notes: list[str] = list(getattr(self.task, "notes", ()))   # e.g. which data format was read
        if job.resume is not None:
            self._restore(job.resume)
        elif cfg.resume == "latest":
            self.notes.append(f"resume: no checkpoint in {cfg.save_dir} yet, starting from step 0")

    def train_step(self, batch: dict, k: int):
        """One optimizer step k -> (global-batch mean loss, grad norm or None)."""
        # The step's non-padding tokens are summed over replicas in the loss's own all-reduce.
        with riding_with_the_loss(batch["attention_mask"].sum()) as tokens:
            loss = self.runner.step(batch)
        self._step_tokens = tokens.total
        norm = self.runner.clip_grad_norm_(self.cfg.clip_grad) if self.cfg.clip_grad is not None else None
        self.schedule.apply(self.optimizer, k)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss, norm

    def global_tokens(self, batch: dict) -> int:
        """Non-padding tokens of the whole global batch (replicas hold different rows): summed
        with the loss by the train_step that just ran on `batch`, else by an all-reduce."""
        summed, self._step_tokens = getattr(self, "_step_tokens", None), None
        if summed is not None:
            return int(summed.sum().item())
        tokens = batch["attention_mask"].sum()
        if self.mesh.dp_pg is not None:
            waiting.all_reduce(tokens, group=self.mesh.dp_pg)
        return int(tokens)

    # --- checkpoint state -------------------------------------------------------------------

    def layout(self) -> dict:
        """What the random streams depend on (galaxy/train/rng_state.py), as a checkpoint records it."""
        return layout_record(self.plan, self.env.world, self.env.device.type)

    def trainer_state(self) -> dict:
        return {"tokens_seen": self.tokens_seen, "data": self.batches.state_dict(),
                "schedule": self.schedule.state_dict(), "optimizer": self.cfg.optimizer,
                "layout": self.layout(), **self.task.identity(), "batch_size": self.cfg.batch_size}

    def _restore(self, ckpt: Checkpoint) -> None:
        state = ckpt.state
        # Each pipeline stage takes its own parameters' state; the stages then agree (collective)
        # that none failed and that every saved parameter found its stage.
        error, others = None, set()
        try:
            others = load_optimizer_state(self.model, self.optimizer, ckpt.optimizer_tensors(),
                                          state["optimizer_groups"])
        except ValueError as e:
            error = str(e)
        agree_on_load(self.mesh, error, others, "optimizer state")
        self.batches.load_state_dict(state["data"])
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        self.saved_step = self.step
        saved = saved_layout(state["layout"], self.job.shape["num_hidden_layers"])
        now = self.layout()
        restore_rng(self.model, self.env.device, ckpt.rng_tensors(), same_layout=saved == now,
                    same_stages=saved["stages"] == now["stages"],
                    seed=self.cfg.seed, step=self.step, stage=self.mesh.pp_rank)
        if state["schedule"] != self.schedule.state_dict():
            self.notes.append(f"resume: the learning-rate schedule {state['schedule']} of the checkpoint "
                              f"differs from the config's {self.schedule.state_dict()}; using the config's")
        self.notes.append(f"resume: continuing from {ckpt.path} at step {self.step}")

    def save(self) -> None:
        cfg = self.cfg
        path = save_checkpoint(cfg.save_dir, self.step, model=self.model, optimizer=self.optimizer,
                               trainer_state=self.trainer_state(), base_model_path=cfg.model_path,
                               class_names=self.task.class_names, tokenizer=self.job.tokenizer,
                               device=self.env.device, lead=self.lead, keep=cfg.keep_checkpoints,
                               mesh=self.mesh)
        self.saved_step = self.step
        self._note(f"checkpoint: {path}")

    # --- evaluation ---------------------------------------------------------------------------

    def evaluate(self, examples) -> dict:
        # Every rank evaluates every example: a Galaxy group needs all of them for each forward.
        return self.task.evaluate(self.runner, examples, self.env.device, self.autocast)

    def _log_evaluation(self, metrics, event: str, examples) -> dict | None:
        """Evaluate a held-out set (None: no such set) and log it as {"event": event, "step", ...}."""
        if not examples:
            return None
        result = self.evaluate(examples[:self.cfg.max_eval_samples])     # None: all of them
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
                          world=env.world, plan=[self.plan.att, self.plan.mlp, self.plan.con])
        for note in self.notes:
            self._note(note)
        first_step, start = self.step, time.perf_counter()
        loss_value, run_tokens, train_time = self._train(metrics)
        summary = {"steps": self.step, "steps_this_run": self.step - first_step, "tokens": run_tokens,
                   "tokens_per_s": round(run_tokens / train_time, 1) if train_time else 0.0,
                   "final_loss": loss_value}
        for split, event, examples in (("dev", "eval", self.task.dev_set), ("test", "test", self.task.test_set)):
            result = self._log_evaluation(metrics, event, examples)
            if result is not None:
                summary.update({f"{split}_{key}": value for key, value in result.items()})
        if cfg.save_dir and self.saved_step != self.step:
            self.save()
        if cfg.export_dir and self.peft.method != "full":
            export_peft(self.model, cfg.export_dir, base_model_path=cfg.model_path, lead=self.lead,
                        merge=cfg.merge_lora, class_names=self.task.class_names, tokenizer=job.tokenizer,
                        mesh=self.mesh)
            self._note(f"export: {cfg.export_dir} ({'merged weights' if cfg.merge_lora else 'adapter'})")
        elif cfg.export_dir:
            export_hf(self.model, cfg.export_dir, base_model_path=cfg.model_path, class_names=self.task.class_names,
                      tokenizer=job.tokenizer, lead=self.lead, mesh=self.mesh)
            self._note(f"export: {cfg.export_dir}")
        summary["wall_s"] = round(time.perf_counter() - start, 3)
        summary["peak_memory_mib"], summary["peak_memory_of"] = gather_peak_memory(env.device, env.launch_rank)
        metrics.log_event("done", **summary)
        metrics.close()
        counts = parameter_counts(self.model, self.mesh.pp_pg)    # collective: every stage's own
        if self.lead:
            print(format_summary(summary, env.device), flush=True)
            print(f"parameters: {peft_summary(self.model, counts)}", flush=True)
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
                    raise FloatingPointError(f"the loss became {loss_value} at step {self.step + 1}; lower "
                                             "learning_rate, set clip_grad, or check the data")
                self.step += 1
                tokens = self.global_tokens(batch)
                dt = time.perf_counter() - t0
                run_tokens, train_time = run_tokens + tokens, train_time + dt
                self.tokens_seen += tokens
                extra = {} if norm is None else {"grad_norm": norm.item()}
                metrics.log_step(self.step, loss_value, self.optimizer.param_groups[0]["lr"], tokens, dt, **extra)
                # The final evaluation and save happen after the loop, once.
                if cfg.eval_interval and self.step % cfg.eval_interval == 0 and self.step < self.total:
                    dev = self._log_evaluation(metrics, "eval", self.task.dev_set)
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
            names = self.task.class_names
            print(f"plot: {plot_metrics(self.cfg.metrics_file, chance=1 / len(names) if names else None)}")
        except ImportError:
            print("plot: skipped (matplotlib is not installed; pip install -e '.[demo]')")


ClassifierTrainer = Trainer


def train(job: Job, env) -> dict:
    return Trainer(job, env).fit()


train_classifier = train
