"""Rank-side helpers for PEFT fidelity tests.

LoRA: galaxy (any plan, DP, PP) against peft's LoRA on Hugging Face's model trained serially on
every rank, both started from the same peft adapter directory. Adapters and side-tuning: galaxy
under a plan against galaxy serial (a one-rank group in the same process), same seed.
"""
from __future__ import annotations

import torch

from parity import HF_LOADERS, lockstep_sgd, rel_err, world_group
from parity_runners import replica_rows

from galaxy.distributed.group import GalaxyGroup
from galaxy.distributed.mesh import make_mesh
from galaxy.models.build import model_class
from galaxy.runtime.assemble import build_model
from galaxy.models.registry import family_of
from galaxy.parallel.full_state import full_sequence_logits, gather_full
from galaxy.parallel.grad_sync import GradientSync
from galaxy.peft import PeftOptions, apply_peft
from galaxy.peft.export import lora_adapter_state
from galaxy.peft.peft_format import peft_key
from galaxy.runtime.runners import build_runner

def write_peft_adapter(family: str, model_dir: str, out_dir: str, targets: list[str], r: int = 4,
                       alpha: float = 8.0, seed: int = 1) -> str:
    """A peft adapter directory with random, non-zero A and B (and classifier, for BERT)."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    task = model_class(family_of(family), None).peft_task_type
    model = get_peft_model(HF_LOADERS[family](model_dir), LoraConfig(task_type=task, r=r, lora_alpha=alpha,
                                                             target_modules=targets))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(0.2 * torch.randn_like(p))
    model.save_pretrained(out_dir)
    return out_dir


def peft_reference(family: str, model_dir: str, adapter_dir: str):
    from peft import PeftModel
    return PeftModel.from_pretrained(HF_LOADERS[family](model_dir), adapter_dir, is_trainable=True).train()


def reference_tensors(ref) -> dict[str, torch.Tensor]:
    """What peft's save_pretrained writes: adapter_model.safetensors' tensors by key."""
    from peft import get_peft_model_state_dict
    return get_peft_model_state_dict(ref)


def compare_tensors(ours: dict, theirs: dict) -> tuple[float, str]:
    """Worst relative error over tensors of the same names, and where. As in
    parity.worst_param_error, each tensor's error is relative to max(its own scale, 1e-3 x the
    largest reference value): a scalar gate that is still near zero holds mostly rounding."""
    assert set(ours) == set(theirs), (sorted(set(ours) ^ set(theirs)))[:4]
    floor = 1e-3 * max(t.abs().max().item() for t in theirs.values())
    return max((((ours[k] - theirs[k]).abs().max() / max(theirs[k].abs().max().item(), floor)).item(), k)
               for k in theirs)


def _sgd(params, lr):
    return torch.optim.SGD([p for p in params if p.requires_grad], lr=lr)


def lora_plan_vs_peft(family: str, model_dir, adapter_dir, plan, shares, batch_fn, steps=5, lr=0.1):
    """5 SGD steps of galaxy LoRA under `plan` and of peft serially. Returns
    {"loss": per-step rel errors, "tensors": (worst rel error, key) of the adapter tensors,
    "logits": step-0 rel error, "frozen_grads": frozen parameters that got a gradient}."""
    torch.manual_seed(0)
    group = world_group(*shares)
    model = build_model(model_dir, plan, group, num_labels=3)
    trainable = apply_peft(model, PeftOptions("lora", lora_path=adapter_dir), seed=0)
    ref = peft_reference(family, model_dir, adapter_dir)
    report = {"loss": []}
    for step, logits, loss, out in lockstep_sgd(model, ref, GradientSync(model, group.pg), trainable.values(),
                                                batch_fn, steps, lr):
        if step == 0:
            report["logits"] = rel_err(full_sequence_logits(model, logits), out.logits)
            report["frozen_grads"] = [n for n, p in model.named_parameters()
                                      if not p.requires_grad and p.grad is not None]
        report["loss"].append(rel_err(loss, out.loss))
    report["tensors"] = compare_tensors(lora_adapter_state(model), reference_tensors(ref))
    return report


def peft_runner(model_dir, plan, pp: int, dp: int, shares, options, num_microbatches: int,
                dp_sharding: str = "none"):
    """(mesh, this rank's runner, its trainable parameters): build_runner applies PEFT to the
    model (or pipeline stage) before DDP (or FSDP, under dp_sharding) and gradient sync wrap it.
    The trainable parameters are the runner's, after wrapping (FSDP replaces them by sharded ones)."""
    torch.manual_seed(0)
    mesh, trainable = make_mesh(pp, dp, *shares), {}
    runner = build_runner(model_dir, plan, mesh, num_labels=3, num_microbatches=num_microbatches,
                          adapt=lambda model: trainable.update(apply_peft(model, options, seed=0)),
                          dp_sharding=dp_sharding)
    return mesh, runner, {n: p for n, p in runner.named_parameters() if n in trainable}


def lora_mesh_vs_peft(family: str, model_dir, adapter_dir, plan, pp: int, dp: int, shares, batch_fn,
                      steps=5, lr=0.1, global_batch=8, num_microbatches=2, dp_sharding="none"):
    """LoRA on a pp x dp x Galaxy mesh (DataParallelRunner / PipelineRunner) against peft serially."""
    mesh, runner, trainable = peft_runner(model_dir, plan, pp, dp, shares,
                                          PeftOptions("lora", lora_path=adapter_dir), num_microbatches, dp_sharding)
    opt, ref = _sgd(trainable.values(), lr), peft_reference(family, model_dir, adapter_dir)
    ref_opt = _sgd(ref.parameters(), lr)
    to_hf = family_of(family).hf_names(runner.model.config)
    report = {"loss": []}
    for step in range(steps):
        batch = batch_fn(seed=step, batch=global_batch)
        out = ref(**batch)
        out.loss.backward()
        loss = runner.step(replica_rows(batch, mesh.dp_rank, dp))
        report["loss"].append(rel_err(loss, out.loss))
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    full = runner.full_state()
    ours = {peft_key(to_hf(n)): t for n, t in full.items()
            if ".lora_" in n or n.startswith("classifier.")}
    report["tensors"] = compare_tensors(ours, reference_tensors(ref))
    return report


def serial_group(shares) -> GalaxyGroup:
    return GalaxyGroup.serial(*(sum(s) for s in shares))


def _galaxy_peft(model_dir, plan, group, options, seed=0):
    model = build_model(model_dir, plan, group, num_labels=3)
    trainable = apply_peft(model, options, seed=seed)
    return model, trainable


def peft_plan_vs_serial(model_dir, plan, shares, options, batch_fn, steps=5, lr=0.5):
    """Adapters / side-tuning: galaxy under `plan` against galaxy serial, same seed and batches.
    Returns {"loss": per-step rel errors, "tensors": (worst, name) over the trained tensors,
    "logits": step-0 rel error, "base_logits": step-0 rel error against the model without PEFT}."""
    torch.manual_seed(0)
    group = world_group(*shares)
    model, trainable = _galaxy_peft(model_dir, plan, group, options)
    ref, ref_trainable = _galaxy_peft(model_dir, plan, serial_group(shares), options)
    assert set(trainable) == set(ref_trainable)
    sync = GradientSync(model, group.pg)
    opt, ref_opt = _sgd(trainable.values(), lr), _sgd(ref_trainable.values(), lr)
    report = {"loss": []}
    for step in range(steps):
        batch = batch_fn(seed=step)
        logits, loss = model(**batch)
        ref_logits, ref_loss = ref(**batch)
        loss.backward()
        ref_loss.backward()
        sync()
        if step == 0:
            report["logits"] = rel_err(full_sequence_logits(model, logits), ref_logits)
        report["loss"].append(rel_err(loss, ref_loss))
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    full = gather_full(model)
    report["tensors"] = compare_tensors({n: full[n] for n in trainable},
                                        {n: p.detach() for n, p in ref_trainable.items()})
    return report


def mesh_vs_serial(model_dir, plan, pp: int, dp: int, shares, options, batch_fn, steps=5, lr=0.5,
                   global_batch=8, num_microbatches=2, dp_sharding="none"):
    """Adapters / side-tuning on a pp x dp x Galaxy mesh against galaxy serial (whole batch)."""
    mesh, runner, trainable = peft_runner(model_dir, plan, pp, dp, shares, options, num_microbatches, dp_sharding)
    ref, ref_trainable = _galaxy_peft(model_dir, plan, serial_group(shares), options)
    opt, ref_opt = _sgd(trainable.values(), lr), _sgd(ref_trainable.values(), lr)
    report = {"loss": []}
    for step in range(steps):
        batch = batch_fn(seed=step, batch=global_batch)
        _, ref_loss = ref(**batch)
        ref_loss.backward()
        loss = runner.step(replica_rows(batch, mesh.dp_rank, dp))
        report["loss"].append(rel_err(loss, ref_loss))
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    full = runner.full_state()
    report["tensors"] = compare_tensors({n: full[n] for n in ref_trainable},
                                        {n: p.detach() for n, p in ref_trainable.items()})
    return report


def base_outputs_kept(model_dir, plan, shares, options, batch_fn) -> bool:
    """At step 0 the PEFT model's logits equal the base model's bit for bit."""
    group = world_group(*shares)
    base = build_model(model_dir, plan, group, num_labels=3)
    model, _ = _galaxy_peft(model_dir, plan, group, options)
    batch = batch_fn(seed=0)
    return torch.equal(base(**batch)[0], model(**batch)[0])
