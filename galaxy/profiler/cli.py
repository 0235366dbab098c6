"""profile_flops.py: profile one training step of the model a config describes, under its plan.

    python profile_flops.py --model bert --config_file train_config/bert/profile.json [--json OUT]
    python profile_flops.py --model bert --config_file C --world 2 --rank 0   (one per rank, or torchrun)

galaxy.launch.main parses the arguments (its own and this script's, see add_arguments), checks
the config, starts the process group and owns the exit codes, as for every entry script. The batch is
synthetic (random token ids, no padding, seeded): FLOPs and bytes do not depend on token values.
Rank 0 prints the module tree, the sub-block summary, and under a plan every rank's local FLOPs
and communication; --json writes the report (schema: docs/profiling.md).

dp_deg > 1: every data-parallel replica profiles its rows (batch_size / dp_deg, or its dp_batch_list
entry) on its Galaxy group's model; the figures are those of replica 0's ranks. The gradient reduction over the replicas (DDP's
all-reduce, or FSDP's gathers and reduce-scatters) is not in the step; under dp_sharding the memory
report divides weights, gradients and optimizer state over the dp_deg replicas.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
from dataclasses import dataclass

import torch
import torch.distributed as dist

from galaxy.config import ConfigError
from galaxy.models.shape import read_model_shape
from galaxy.launch import main as launch_main
from galaxy.models.registry import FAMILIES, family_of
from galaxy.plan_shares import rows_per_replica
from galaxy.profiler.profile import profile_model
from galaxy.profiler.table import comm_table, human, human_check, module_table, sub_block_table, summary

SCRIPT = "profile_flops.py"


@dataclass
class ProfileJob:
    cfg: object
    opts: argparse.Namespace
    shape: dict
    hf: object             # the model folder's Hugging Face config
    num_labels: int | None

    @property
    def family(self):
        return family_of(self.hf.model_type)

    @property
    def task_kind(self) -> str:
        """An encoder-decoder's: the config's task (its closed forms know both heads, the LM head
        and the classifier); any other family's: its primary task."""
        task = getattr(self.cfg, "task", None)
        if self.encoder_decoder and task in self.family.tasks:
            return task
        return next(iter(self.family.tasks))

    @property
    def encoder_decoder(self) -> bool:
        return bool(self.shape.get("is_encoder_decoder"))

    @property
    def target_tokens(self) -> int | None:
        """An encoder-decoder's decoder tokens per row (target_pad_size, else pad_size); None
        for a one-stack model."""
        return (self.cfg.target_pad_size or self.cfg.pad_size) if self.encoder_decoder else None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The profiler's own options, next to launch's --config_file, --world, --rank, --init_method."""
    p.description = ("FLOPs, parameters, latency, activation bytes and communication of one training step "
                     "of the model in a Galaxy config, under the config's plan.")
    p.add_argument("--model", required=True, choices=sorted(FAMILIES),
                   help="model family the config's model_path must hold")
    p.add_argument("--json", metavar="OUT", help="also write the report as JSON to OUT (rank 0)")
    p.add_argument("--depth", type=int, default=3, help="module tree depth to print (default 3)")
    p.add_argument("--repeats", type=int, default=3, help="timed steps; the median is reported (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before timing (default 1)")
    p.add_argument("--compare-deepspeed", action="store_true",
                   help="also count the forward with deepspeed's flops profiler and print both totals")


def prepare(cfg, opts) -> ProfileJob:
    """Checks before any process group starts (a mistake is one line and exit status 2)."""
    if cfg.plan.pp > 1:
        raise ConfigError("pp_deg > 1 is not supported by the profiler yet; set it to 1")
    shape = read_model_shape(cfg.model_path)
    try:
        family = family_of(shape["model_type"])
    except ValueError as e:
        raise ConfigError(f"model_path: {e}") from None
    if family.name != opts.model:
        raise ConfigError(f"--model {opts.model} but model_path holds a {shape['model_type']!r} model; "
                          f"use --model {family.name} or another config")
    if family.matmul_flops is None:
        profiled = sorted(name for name, spec in FAMILIES.items() if spec.matmul_flops is not None)
        raise ConfigError(f"--model {family.name}: the profiler has no closed forms for {family.name} models yet; "
                          f"it profiles {', '.join(profiled)}")
    if opts.compare_deepspeed and importlib.util.find_spec("deepspeed") is None:
        raise ConfigError("--compare-deepspeed needs deepspeed, which is not installed; "
                          "pip install deepspeed or drop the flag")
    if opts.repeats < 1 or opts.warmup < 0 or opts.depth < 0:
        raise ConfigError("--repeats must be at least 1, --warmup and --depth at least 0")
    from galaxy.models.build import load_hf_config
    hf = load_hf_config(cfg.model_path)
    num_labels = None
    job = ProfileJob(cfg, opts, shape, hf, None)
    if job.task_kind == "classification":    # the classifier the trainer would build: one output per class
        names = cfg.class_list
        if names is None:
            from galaxy.data import load_examples
            names = load_examples(cfg.train_path, "train")[1]
        num_labels = len(names)
    return ProfileJob(cfg, opts, shape, hf, num_labels)


def synthetic_batch(task: str, batch: int, seq: int, vocab: int, num_labels: int | None, seed: int,
                    device, target: int | None = None) -> dict:
    """The same batch on every rank: random ids (no padding), full attention mask. seq2seq:
    labels [batch, target], random too (the decoder reads them shifted right)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (batch, seq), generator=g)
    out = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
    if task == "classification":
        out["token_type_ids"] = torch.zeros_like(ids)
        out["labels"] = torch.randint(0, num_labels, (batch,), generator=g)
    elif task == "seq2seq":
        out["labels"] = torch.randint(1, vocab, (batch, target), generator=g)
    else:
        out["labels"] = ids.clone()
    return {k: v.to(device) for k, v in out.items()}


def replica_rows(cfg, plan, dp_rank: int) -> int:
    """The rows replica dp_rank profiles: batch_size / dp_deg, or its dp_batch_list entry."""
    return rows_per_replica(plan.replica_rows, cfg.batch_size, plan.dp)[dp_rank]


def closed_form_flops(job: ProfileJob) -> int:
    """Forward matrix FLOPs of the serial model on one replica's rows (the whole batch without data
    parallelism), from the family's closed form."""
    rows = replica_rows(job.cfg, job.cfg.plan, 0)
    target = {} if job.target_tokens is None else {"target": job.target_tokens}
    return job.family.matmul_flops(job.hf, rows, job.cfg.pad_size, job.num_labels, **target)["total"]


def closed_form_comm(job: ProfileJob, plan) -> dict:
    """Bytes per collective kind the (resolved) plan's transitions, head and gradient sync should move
    per rank (one replica's rows)."""
    head = {"num_labels": job.num_labels} if job.encoder_decoder else {}    # its LM head or its classifier
    return job.family.plan_comm_bytes(plan, job.hf, replica_rows(job.cfg, plan, 0), plan.tokens,
                                      comm_chunks=plan.comm_chunks, **head)


def run(job: ProfileJob, env) -> None:
    from galaxy.runtime.assemble import build_model
    from galaxy.parallel.grad_sync import GradientSync
    from galaxy.runtime.runners import plan_and_mesh
    cfg, opts = job.cfg, job.opts
    torch.manual_seed(cfg.seed)
    plan, mesh = plan_and_mesh(cfg, env.world, job.shape)
    model = build_model(cfg.model_path, plan, mesh.galaxy, num_labels=job.num_labels, seed=cfg.seed,
                        device=env.device, dropout=cfg.dropout, task=job.task_kind)
    rows = replica_rows(cfg, plan, mesh.dp_rank)
    batch = synthetic_batch(job.task_kind, rows, cfg.pad_size, job.hf.vocab_size, job.num_labels, cfg.seed,
                            env.device, job.target_tokens)
    plan_dict = None
    if mesh.galaxy.size > 1:
        plan_dict = {"att": plan.att, "mlp": plan.mlp, "con": plan.con}
        if job.target_tokens is not None:
            plan_dict["xatt"] = plan.method("xatt")
    report = profile_model(model, batch, grad_sync=GradientSync(model, mesh.galaxy.pg),
                           repeats=opts.repeats, warmup=opts.warmup, plan=plan_dict,
                           optimizer_states=2 if cfg.optimizer == "adamw" else 0,
                           dp_shards=plan.dp if plan.dp_sharding != "none" else 1)
    if plan.dp > 1:
        report.notes.append(f"data parallel: the {plan.dp} replicas run "
                            f"{rows_per_replica(plan.replica_rows, cfg.batch_size, plan.dp)} "
                            f"of the {cfg.batch_size} rows; the gradient reduction over the replicas "
                            f"({'FSDP, ' + plan.dp_sharding if plan.dp_sharding != 'none' else 'DDP'}) is not profiled")
    deepspeed_flops = None
    if opts.compare_deepspeed:
        from galaxy.profiler.deepspeed_compare import deepspeed_forward_flops
        deepspeed_flops = deepspeed_forward_flops(model, batch)
    reports = [report]
    if env.world > 1:
        reports = [None] * env.world
        dist.all_gather_object(reports, report)
        reports = reports[:mesh.galaxy.size]     # replica 0's Galaxy group (ranks 0..N-1); replicas are alike
    if env.rank != 0:
        return
    expected_comm = closed_form_comm(job, plan) if len(reports) > 1 else None
    print(render(reports, job, opts.depth, expected_comm, deepspeed_flops), flush=True)
    if opts.json:
        write_json(opts.json, reports, closed_form_flops(job), expected_comm)


def render(reports, job, depth, expected_comm=None, deepspeed_flops=None) -> str:
    report = reports[0]
    expected = closed_form_flops(job)
    out = [summary(report), "", module_table(report, depth), "", "Per sub-block (CON1 and CON2 are the two "
           "connectives of a layer; a CON method applies to both)", sub_block_table(report), ""]
    if len(reports) == 1:
        out.append(f"closed form ({job.opts.model}) forward matrix FLOPs {human(expected, 'FLOPs')}: "
                   f"measured {human(report.totals.fwd_flops, 'FLOPs')} ({human_check(report.totals.fwd_flops, expected)})")
    else:
        out.append(f"Per rank, one training step (forward, backward, gradient sync); serial closed form "
                   f"forward {human(expected, 'FLOPs')}")
        out.append(comm_table(reports, expected_comm))
    if deepspeed_flops is not None:
        t = report.totals
        out.append(f"forward FLOPs, rank {report.rank}: galaxy matrix products {human(t.fwd_flops, 'FLOPs')}, "
                   f"galaxy with element-wise {human(t.fwd_flops + t.elementwise_flops, 'FLOPs')}, "
                   f"deepspeed {human(deepspeed_flops, 'FLOPs')}")
    return "\n".join(out)


def write_json(path: str, reports, closed_form_fwd: int, expected_comm) -> None:
    doc = reports[0].to_dict()
    doc["closed_form"] = {"fwd_flops": closed_form_fwd, "comm_by_kind": expected_comm}
    doc["ranks"] = [{"rank": r.rank, "totals": r.to_dict()["totals"], "comm": r.comm,
                     "sub_blocks": r.to_dict()["sub_blocks"]} for r in reports]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)


def main(argv=None) -> None:
    launch_main(preset="galaxy", train_fn=run, script=SCRIPT, argv=argv, prepare_fn=prepare,
                add_arguments=add_arguments)
