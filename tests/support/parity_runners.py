"""The one loop of the fidelity tests: galaxy (a runner on a pp x dp x Galaxy mesh) and a serial
reference trained side by side with SGD on the same global batches, then compared.

Every rank trains the reference on the whole global batch, while the runner sees only this
replica's rows and this rank's stage and shards. The reference is Hugging Face's model (or peft's
LoRA on it) or galaxy's own model on a one-rank group (adapters, side-tuning: peft has no format
for them). A plain Galaxy plan is the mesh pp 1 x dp 1.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from support.parity import HF_LOADERS, rel_err, worst_param_error

from galaxy.distributed.mesh import make_mesh
from galaxy.models.shape import read_model_shape
from galaxy.parallel.full_state import full_sequence_logits
from galaxy.parallel.dtensors import local
from galaxy.plan import Plan, even_split
from galaxy.runtime.runners import build_runner
from galaxy.train.optim import OPTIMIZERS, build_optimizer

DEFAULTS = {"pp": 1, "dp": 1, "global_batch": 8, "stage_layers": None, "num_microbatches": 1, "schedule": "1f1b",
            "grad_accum_steps": 1, "steps": 5, "lr": None, "activation_checkpointing": "none", "task": None,
            "adapt": None, "dp_sharding": "none", "comm_chunks": 1, "kv_blocks": False, "optimizer": None,
            "dp_batch": None, "batch_streams": None, "warmup": None}
# SGD's learning rate when a test names none: the largest at which the family's test model trains
# 5 steps without amplifying rounding. At 0.5 the tiny causal LMs' loss climbs (4.91 -> 5.28 on the
# tied tiny Llama), and HF's own model, its gradients perturbed by 1e-7 relative, ends 8.7e-6 away
# in the weights after 5 steps (0.2: 4.6e-7; 0.1: 3.1e-7): two correct fp32 implementations that
# sum in different orders then land near the 1e-5 tolerance, and past it on some CPUs. BERT (the
# all-MiniLM-L6-v2 shape) is stable at 0.5.
STABLE_LR = {"bert": 0.5}
CAUSAL_LM_LR = 0.1


def stable_lr(family: str) -> float:
    return STABLE_LR.get(family, CAUSAL_LM_LR)


def replica_rows(batch: dict, dp_rank: int, dp: int, shares=None) -> dict:
    """This replica's contiguous share of the global batch's rows: even, or shares[dp_rank] rows
    after the earlier replicas' (uneven data parallelism, dp_batch_list)."""
    total = next(iter(batch.values())).shape[0]
    rows = list(shares) if shares is not None else [total // dp] * dp
    start = sum(rows[:dp_rank])
    return {k: v[start:start + rows[dp_rank]] for k, v in batch.items()}


def stored_fraction(model) -> float:
    """Parameter elements this rank stores over those of its (Galaxy-local) part of the model."""
    params = list(model.parameters())
    return sum(local(p).numel() for p in params) / sum(p.numel() for p in params)


def hf_forward(ref):
    """A Hugging Face (or peft) model as a reference: batch -> (logits, loss)."""
    def forward(batch):
        out = ref(**batch)
        return out.logits, out.loss
    return forward


def run_plan(model_dir, plan: Plan, shares, o: dict) -> Plan:
    """The resolved plan a test runs: `plan`'s methods, the shares given (heads, columns, tokens
    and, for an encoder-decoder, its decoder's tokens), and the mesh, stages, micro-batches and
    options of o (DEFAULTS' keys; batch_streams None: the plan's)."""
    heads, columns, tokens, *decoder = shares
    pp, layers = o["pp"], read_model_shape(model_dir)["num_hidden_layers"]
    return replace(plan, pp=pp, dp=o["dp"], heads=tuple(heads), columns=tuple(columns), tokens=tuple(tokens),
                   decoder_tokens=tuple(decoder[0]) if decoder else None,
                   stages=tuple(o["stage_layers"] or even_split(layers, pp)),
                   microbatches=o["num_microbatches"] if pp > 1 else o["grad_accum_steps"], schedule=o["schedule"],
                   checkpoint=o["activation_checkpointing"], dp_sharding=o["dp_sharding"],
                   comm_chunks=o["comm_chunks"], kv_blocks=o["kv_blocks"],
                   batch_streams=o["batch_streams"] or plan.batch_streams,
                   replica_rows=None if o["dp_batch"] is None else tuple(o["dp_batch"]),
                   warmup=None if o["warmup"] is None else tuple(o["warmup"]))


def optimizers(o: dict, params, ref_params) -> tuple:
    """(galaxy's, the reference's) optimizer. o["optimizer"] None: plain SGD on both sides; "sgd" or
    "adamw": galaxy's as training builds it (galaxy.train.optim: the fastest step torch supports
    for these parameters) against torch's one-tensor-at-a-time loop on the reference."""
    params, ref_params = [p for p in params if p.requires_grad], [p for p in ref_params if p.requires_grad]
    if o["optimizer"] is None:
        return torch.optim.SGD(params, lr=o["lr"]), torch.optim.SGD(ref_params, lr=o["lr"])
    return (build_optimizer(o["optimizer"], params, o["lr"]),
            OPTIMIZERS[o["optimizer"]](ref_params, lr=o["lr"], weight_decay=0.0, foreach=False))


def train_and_compare(model_dir, plan, shares, batch_fn, reference, o: dict, at_step0=None) -> dict:
    """o["steps"] optimizer steps (optimizers(o)) of galaxy's runner and of `reference` (a (forward, parameters) pair,
    forward: whole batch -> (logits, loss)) on the same batches; only parameters that require a
    gradient train on either side.

    o: DEFAULTS' keys; global_batch None calls batch_fn(seed=step) with its own batch size; adapt
    changes the model before DDP and gradient sync wrap it (build_runner's, e.g. apply_peft).
    at_step0(runner, mesh): called at step 0 after both backward passes (and galaxy's gradient
    sync), before the updates; what it returns joins the report.
    Returns {"loss" (per-step rel error), "logits" (step 0, the runner's forward against the
    reference's rows), "stage" (this rank's layers), "stored" (elements this rank stores /
    elements of its Galaxy-local part, at the end: 1 unless dp-sharded), "runner", "mesh",
    **at_step0's}.
    """
    assert o["lr"] is not None, "train_and_compare needs o['lr'] (stable_lr(family) when a test names none)"
    torch.manual_seed(0)
    plan = run_plan(model_dir, plan, shares, o)
    mesh = make_mesh(plan)
    runner = build_runner(model_dir, plan, mesh, num_labels=3, task=o["task"], adapt=o["adapt"])
    forward, ref_params = reference
    opt, ref_opt = optimizers(o, runner.parameters(), ref_params)
    stage = runner.model.attached.stage
    report = {"loss": [], "stage": list(stage.layers if stage else []), "runner": runner, "mesh": mesh}
    for step in range(o["steps"]):
        batch = batch_fn(seed=step) if o["global_batch"] is None else batch_fn(seed=step, batch=o["global_batch"])
        local = replica_rows(batch, mesh.dp_rank, o["dp"], plan.replica_rows)
        ref_logits, ref_loss = forward(batch)
        ref_loss.backward()
        if step == 0:
            logits, _ = runner(**{k: v for k, v in local.items() if k != "labels"})
            rows = replica_rows({"x": ref_logits.detach()}, mesh.dp_rank, o["dp"], plan.replica_rows)["x"]
            report["logits"] = rel_err(full_sequence_logits(runner.model, logits.detach()), rows)
        loss = runner.step(local)
        if step == 0 and at_step0 is not None:
            report.update(at_step0(runner, mesh))
        report["loss"].append(rel_err(loss, ref_loss))
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    report["stored"] = stored_fraction(runner.model)     # after training, evaluation and gathers
    return report


def train_runner_and_compare(family: str, model_dir, plan, pp: int, dp: int, shares, batch_fn,
                             options: dict | None = None) -> dict:
    """Galaxy on a pp x dp x Galaxy mesh against Hugging Face's model trained serially.

    options (a dict, since DistPool.run passes positional arguments only): DEFAULTS' keys (lr None:
    stable_lr(family)); task
    None is the family's primary one, else the reference is HF_LOADERS[f"{family}/{task}"].
    Returns {"logits", "loss", "grad" (step 0: worst, where), "grad_norm" (step 0, the whole
    model's), "weights" (worst, where), "stage"}.
    """
    o = {**DEFAULTS, **(options or {}), "pp": pp, "dp": dp}
    if o["lr"] is None:
        o["lr"] = stable_lr(family)
    ref = HF_LOADERS[family if o["task"] is None else f"{family}/{o['task']}"](model_dir)

    def grads(runner, mesh):
        # HF's parameters() yields a tied weight once: the norm counts it once, as ours must.
        ref_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref.parameters()]))
        return {"grad": worst_param_error(runner.full_state(grads=True), ref, True, family),
                "grad_norm": rel_err(runner.grad_norm(), ref_norm)}
    report = train_and_compare(model_dir, plan, shares, batch_fn, (hf_forward(ref), ref.parameters()), o, grads)
    report["weights"] = worst_param_error(report.pop("runner").full_state(), ref, False, family)
    del report["mesh"]
    return report


def train_plan_and_compare(family: str, model_dir, plan, shares, batch_fn, steps=5, lr=None, build=None) -> dict:
    """A Galaxy plan (pp 1 x dp 1) against Hugging Face on batch_fn's own batch size.

    build: more keywords (a dict): activation_checkpointing, task, comm_chunks, kv_blocks."""
    return train_runner_and_compare(family, model_dir, plan, 1, 1, shares, batch_fn,
                                    {"global_batch": None, "steps": steps, "lr": lr, **(build or {})})


def train_plans_and_compare(family: str, model_dir, plans, shares, batch_fn, build=None) -> list:
    """train_plan_and_compare (build: its keywords) for each plan in turn, in one call to the pool
    (a process launch's worth of cases); returns [(plan, report)]."""
    return [(plan, train_plan_and_compare(family, model_dir, plan, shares, batch_fn, build=build)) for plan in plans]


def train_runners_and_compare(cases) -> list:
    """train_runner_and_compare for each case (a tuple of its positional arguments) in turn, in
    one call to the pool; returns the reports in case order."""
    return [train_runner_and_compare(*case) for case in cases]


def export_and_reload_classifier(model_dir, out_dir, plan: Plan, group, batch: dict, hf_class) -> tuple:
    """A 3-class classifier under `plan` on `group` -> export_hf -> hf_class.from_pretrained:
    (relative error of the logits on `batch`, the export's architectures, its id2label)."""
    import torch.distributed as dist

    from galaxy.assets.packaged_minilm import tokenizer
    from galaxy.runtime.assemble import build_model
    from galaxy.runtime.export import export_hf
    model = build_model(model_dir, plan, group, num_labels=3, task="classification").eval()
    with torch.no_grad():
        logits, _ = model(batch["input_ids"], batch["attention_mask"])
    export_hf(model, out_dir, base_model_path=model_dir, class_names=["a", "b", "c"], tokenizer=tokenizer(),
              lead=dist.get_rank() == 0)
    dist.barrier()
    hf = hf_class.from_pretrained(out_dir).eval()
    with torch.no_grad():
        want = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return rel_err(logits, want), hf.config.architectures, hf.config.id2label
