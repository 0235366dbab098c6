"""Rank-side helpers for fidelity tests: run galaxy under a plan and HF serially, compare."""
from __future__ import annotations

import torch
import torch.distributed as dist


from galaxy.distributed.group import GalaxyGroup
from galaxy.models.registry import family_of
from galaxy.parallel.full_state import full_sequence_logits, gather_full
from galaxy.parallel.grad_sync import GradientSync
from galaxy.parallel.plan import ParallelPlan
from galaxy.runtime.assemble import build_model


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to max |b| (the scale of the reference tensor)."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def world_group(heads, inter, seq) -> GalaxyGroup:
    rank, world = dist.get_rank(), dist.get_world_size()
    return GalaxyGroup(rank, world, dist.group.WORLD if world > 1 else None,
                       tuple(heads), tuple(inter), tuple(seq))


def hf_bert(model_dir):
    from transformers import BertForSequenceClassification
    return BertForSequenceClassification.from_pretrained(model_dir, attn_implementation="eager").train()


def worst_param_error(galaxy_full: dict, hf_model, grads: bool, family: str = "bert") -> tuple[float, str]:
    """Largest relative error over all parameters (or gradients), and where it is (galaxy's name).

    galaxy_full: whole tensors by galaxy name, compared by Hugging Face name in Hugging Face's
    layout (FamilySpec.hf_state: GPT-2's Conv1D weights transposed).

    Some gradients are exactly zero in exact arithmetic (the key bias: softmax ignores a shift
    shared by all keys), so the reference holds only rounding noise there. Each tensor's error is
    therefore taken relative to max(its own scale, 1e-3 x the largest reference value in the
    model): with the 1e-5 tolerance, a tensor whose true value is zero must match to within
    1e-8 of the model's largest value (on all-MiniLM-L6-v2 the key-bias gradient is ~1e-10
    against a largest gradient of ~0.16).
    """
    spec = family_of(family)
    to_hf = spec.hf_names(hf_model.config)
    ref = {n: (p.grad if grads else p.detach()) for n, p in hf_model.named_parameters()}
    floor = 1e-3 * max(t.abs().max().item() for t in ref.values())
    worst, where = 0.0, ""
    for name, t in galaxy_full.items():
        hf = to_hf(name)
        t, r = spec.hf_state(hf_model.config, {name: t})[hf], ref[hf]
        err = ((t - r).abs().max() / max(r.abs().max().item(), floor)).item()
        if err > worst:
            worst, where = err, name
    return worst, where


def lockstep_sgd(model, ref, sync, params, batch_fn, steps: int, lr: float):
    """SGD on galaxy's model (its `params`) and on the reference, batch for batch.

    Yields (step, logits, loss, reference output) after both backward passes and galaxy's
    gradient sync, before the updates: a caller inspects gradients there.
    """
    opt = torch.optim.SGD(params, lr=lr)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    for step in range(steps):
        batch = batch_fn(seed=step)
        logits, loss = model(**batch)
        out = ref(**batch)
        loss.backward()
        out.loss.backward()
        sync()
        yield step, logits, loss, out
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()


def train_and_compare(family: str, model_dir, plan: ParallelPlan, shares, batch_fn, steps=5, lr=0.5,
                      build=None):
    """Train galaxy under `plan` and HF serially with SGD on the same batches; report errors.

    build: more build_model keywords (a dict, since DistPool.run passes positional arguments
    only), e.g. activation_checkpointing, or task (None: the family's primary one; the reference
    is then HF_LOADERS[f"{family}/{task}"]).
    Returns {"logits", "loss" (per step), "grad" (worst, where), "weights" (worst, where)}.
    """
    torch.manual_seed(0)
    group = world_group(*shares)
    build = build or {}
    task = build.get("task")
    model = build_model(model_dir, plan, group, num_labels=3, **build)
    ref = HF_LOADERS[family if task is None else f"{family}/{task}"](model_dir)
    report = {"loss": []}
    for step, logits, loss, out in lockstep_sgd(model, ref, GradientSync(model, group.pg), model.parameters(),
                                                batch_fn, steps, lr):
        if step == 0:
            report["logits"] = rel_err(full_sequence_logits(model, logits), out.logits)
            report["grad"] = worst_param_error(gather_full(model, grads=True), ref, True, family)
        report["loss"].append(rel_err(loss, out.loss))
    report["weights"] = worst_param_error(gather_full(model), ref, False, family)
    return report


def hf_llama(model_dir):
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM.from_pretrained(model_dir).train()


def hf_qwen2(model_dir):
    from transformers import Qwen2ForCausalLM
    return Qwen2ForCausalLM.from_pretrained(model_dir).train()


def hf_gpt2(model_dir):
    from transformers import GPT2LMHeadModel
    return GPT2LMHeadModel.from_pretrained(model_dir).train()


def hf_llama_classifier(model_dir):
    from transformers import LlamaForSequenceClassification
    return LlamaForSequenceClassification.from_pretrained(model_dir).train()


HF_LOADERS = {"bert": hf_bert, "llama": hf_llama, "qwen2": hf_qwen2, "gpt2": hf_gpt2,
              "llama/classification": hf_llama_classifier}


def check_report(report, rank, tol=1e-5):
    assert report["logits"] < tol, f"rank {rank}: logits off by {report['logits']}"
    assert max(report["loss"]) < tol, f"rank {rank}: losses off by {report['loss']}"
    assert report["grad"][0] < tol, f"rank {rank}: gradient of {report['grad'][1]} off by {report['grad'][0]}"
    if "grad_norm" in report:
        assert report["grad_norm"] < tol, f"rank {rank}: gradient norm off by {report['grad_norm']}"
    assert report["weights"][0] < tol, f"rank {rank}: weight {report['weights'][1]} off by {report['weights'][0]}"
