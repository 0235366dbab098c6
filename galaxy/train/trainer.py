"""The shared training loop of every classification entry script.

prepare_classifier runs before any process group starts (so a bad data file is a one-line
exit 2); train_classifier builds the mesh and the model under the config's plan and trains.
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
from galaxy.models.build import build_model
from galaxy.parallel.grad_sync import GradientSync
from galaxy.parallel.plan import ParallelPlan
from galaxy.train.evaluate import evaluate
from galaxy.train.metrics import MetricsWriter
from galaxy.train.optim import make_optimizer


@dataclass
class ClassifierJob:
    cfg: object
    tokenizer: object
    train_set: list
    dev_set: list | None
    class_names: list[str]
    shape: dict


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
    dev_set = None
    if cfg.dev_path is not None or cfg.train_path is None:
        dev_set, _ = load_examples(cfg.dev_path, "dev", class_names)
    if len(train_set) < cfg.batch_size:
        raise ConfigError(f"batch_size {cfg.batch_size} is larger than the {len(train_set)} training "
                          "examples; lower batch_size")
    tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
    return ClassifierJob(cfg, tokenizer, train_set, dev_set, class_names, shape)


def plan_of(cfg) -> ParallelPlan:
    return ParallelPlan(cfg.att_parallel_method, cfg.mlp_parallel_method, cfg.con_parallel_method)


def train_classifier(job: ClassifierJob, env) -> dict:
    cfg = job.cfg
    torch.manual_seed(cfg.seed)     # identical on every rank: replicated draws stay in lockstep
    mesh = build_mesh(cfg, env.rank, env.world, job.shape)
    model = build_model(cfg.model_path, plan_of(cfg), mesh.galaxy, num_labels=len(job.class_names),
                        seed=cfg.seed, device=env.device, dropout=cfg.dropout)
    model.train()
    sync = GradientSync(model, mesh.galaxy.pg)
    optimizer = make_optimizer(cfg, model.parameters())
    batches = ClassificationBatches(job.train_set, job.tokenizer, cfg.pad_size, cfg.batch_size,
                                    cfg.shuffle, cfg.seed)
    total = len(batches) * cfg.num_epochs
    if cfg.max_steps is not None:
        total = min(total, cfg.max_steps)
    lead = env.rank == 0
    metrics = MetricsWriter(cfg.metrics_file, enabled=lead)
    bar = tqdm(total=total, disable=not lead, desc="train", unit="step", dynamic_ncols=True)
    step, tokens_seen, start = 0, 0, time.perf_counter()
    while step < total:
        batches.set_epoch(step // len(batches))
        for batch in batches:
            t0 = time.perf_counter()
            batch = {k: v.to(env.device, non_blocking=True) for k, v in batch.items()}
            _, loss = model(**batch)
            loss.backward()
            sync()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss_value = loss.item()           # the global-batch mean, the same on every rank
            if not math.isfinite(loss_value):
                raise FloatingPointError(f"loss became {loss_value} at step {step + 1}")
            step += 1
            tokens = int(batch["attention_mask"].sum())
            tokens_seen += tokens
            dt = time.perf_counter() - t0
            metrics.log_step(step, loss_value, optimizer.param_groups[0]["lr"], tokens, dt)
            bar.update(1)
            bar.set_postfix(loss=f"{loss_value:.4f}", tok_s=f"{tokens / dt:.0f}")
            if step >= total:
                break
    bar.close()
    wall = time.perf_counter() - start
    summary = {"steps": step, "wall_s": round(wall, 3), "tokens": tokens_seen,
               "tokens_per_s": round(tokens_seen / max(wall, 1e-9), 1), "final_loss": loss_value}
    if job.dev_set:
        result = evaluate(model, job.dev_set, job.tokenizer, cfg.pad_size, cfg.batch_size, env.device)
        metrics.log_event("eval", step=step, **result)
        summary.update(dev_loss=result["loss"], dev_accuracy=result["accuracy"])
    metrics.log_event("done", **summary)
    metrics.close()
    if lead:
        print("done: " + ", ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
                                   for k, v in summary.items()), flush=True)
    dist.barrier()
    return summary
