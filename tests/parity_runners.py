"""Rank-side helpers for DP / PP fidelity tests: a runner on a mesh against HF serial training.

Every rank also trains the Hugging Face model serially on the whole global batch (the
reference), while the runner sees only this replica's rows and this rank's stage and shards.
"""
from __future__ import annotations

import torch

from parity import HF_LOADERS, rel_err, worst_param_error

from galaxy.distributed.mesh import make_mesh
from galaxy.models.registry import family_of
from galaxy.parallel.full_state import full_sequence_logits
from galaxy.parallel.sharded_dp import local
from galaxy.runtime.runners import build_runner


def replica_rows(batch: dict, dp_rank: int, dp: int) -> dict:
    """This replica's contiguous share of the global batch's rows."""
    rows = next(iter(batch.values())).shape[0] // dp
    return {k: v[dp_rank * rows:(dp_rank + 1) * rows] for k, v in batch.items()}


def stored_fraction(model) -> float:
    """Parameter elements this rank stores over those of its (Galaxy-local) part of the model."""
    params = list(model.parameters())
    return sum(local(p).numel() for p in params) / sum(p.numel() for p in params)


def train_runner_and_compare(family: str, model_dir, plan, pp: int, dp: int, shares, batch_fn,
                             options: dict | None = None) -> dict:
    """5 SGD steps of a runner on a pp x dp x Galaxy mesh and of HF serially; report errors.

    options (a dict, since DistPool.run passes positional arguments only): global_batch (8),
    stage_layers (even split), num_microbatches (1), schedule ("1f1b"), grad_accum_steps (1),
    steps (5), lr (0.5), activation_checkpointing ("none"), dp_sharding ("none").

    Returns {"logits" (step 0, evaluation forward), "loss" (per step), "grad" (worst, where),
    "grad_norm" (step 0, the whole model's), "weights" (worst, where), "stage" (this rank's layers),
    "stored" (elements this rank stores / elements of its Galaxy-local part, at the end: 1 unless
    dp-sharded)}.
    """
    o = {"global_batch": 8, "stage_layers": None, "num_microbatches": 1, "schedule": "1f1b",
         "grad_accum_steps": 1, "steps": 5, "lr": 0.5, "activation_checkpointing": "none",
         "dp_sharding": "none", **(options or {})}
    torch.manual_seed(0)
    mesh = make_mesh(pp, dp, *shares)
    runner = build_runner(model_dir, plan, mesh, num_labels=3, stage_num_hidden_layers_list=o["stage_layers"],
                          num_microbatches=o["num_microbatches"], schedule=o["schedule"],
                          grad_accum_steps=o["grad_accum_steps"],
                          activation_checkpointing=o["activation_checkpointing"], dp_sharding=o["dp_sharding"])
    ref = HF_LOADERS[family](model_dir)
    to_hf = family_of(family).hf_names(ref.config)
    opt = torch.optim.SGD(runner.parameters(), lr=o["lr"])
    ref_opt = torch.optim.SGD(ref.parameters(), lr=o["lr"])
    report = {"loss": [], "stage": list(runner.model.attached.stage.layers if runner.model.attached.stage else [])}
    for step in range(o["steps"]):
        batch = batch_fn(seed=step, batch=o["global_batch"])
        local = replica_rows(batch, mesh.dp_rank, dp)
        out = ref(**batch)
        out.loss.backward()
        if step == 0:
            inputs = {k: v for k, v in local.items() if k != "labels"}
            logits, _ = runner(**inputs)
            rows = replica_rows({"x": out.logits.detach()}, mesh.dp_rank, dp)["x"]
            report["logits"] = rel_err(full_sequence_logits(runner.model, logits), rows)
        loss = runner.step(local)
        if step == 0:
            report["grad"] = worst_param_error(runner.full_state(grads=True), ref, True, to_hf)
            # HF's parameters() yields a tied weight once: the norm counts it once, as ours must.
            ref_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref.parameters()]))
            report["grad_norm"] = rel_err(runner.grad_norm(), ref_norm)
        report["loss"].append(rel_err(loss, out.loss))
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    report["weights"] = worst_param_error(runner.full_state(), ref, False, to_hf)
    report["stored"] = stored_fraction(runner.model)     # after training, evaluation and gathers
    return report
