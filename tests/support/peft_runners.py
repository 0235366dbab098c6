"""Rank-side helpers for PEFT fidelity tests.

LoRA: galaxy (any plan, DP, PP) against peft's LoRA on Hugging Face's model trained serially on
every rank, both started from the same peft adapter directory. Adapters and side-tuning: galaxy
under a plan against galaxy serial (a one-rank group in the same process), same seed.
"""
from __future__ import annotations

import torch

from support.parity import HF_LOADERS, world_group
from support.parity_runners import DEFAULTS, hf_forward, train_and_compare

from galaxy.distributed.group import GalaxyGroup
from galaxy.models.build import model_class
from galaxy.runtime.assemble import build_model
from galaxy.models.registry import family_of
from galaxy.parallel.full_state import full_sequence_logits
from galaxy.parallel.grad_sync import GradientSync
from galaxy.peft import PeftOptions, apply_peft, export_peft
from galaxy.peft.export import lora_adapter_state
from galaxy.peft.peft_format import peft_key


def hf_key(family: str, task: str | None) -> str:
    """HF_LOADERS' key of a family's model for a task (None: its primary one)."""
    return family if task is None else f"{family}/{task}"


def write_peft_adapter(family: str, model_dir: str, out_dir: str, targets: list[str], r: int = 4,
                       alpha: float = 8.0, seed: int = 1, task: str | None = None) -> str:
    """A peft adapter directory with random, non-zero A and B (and the classifier peft saves in
    full: BERT's; a named task's head, e.g. the encoder-decoders' classification_head)."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    cls = model_class(family_of(family), task)
    saved = {"modules_to_save": list(cls.modules_to_save)} if task is not None else {}
    model = get_peft_model(HF_LOADERS[hf_key(family, task)](model_dir),
                           LoraConfig(task_type=cls.peft_task_type, r=r, lora_alpha=alpha, target_modules=targets,
                                      **saved))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(0.2 * torch.randn_like(p))
    model.save_pretrained(out_dir)
    return out_dir


def peft_reference(family: str, model_dir: str, adapter_dir: str, task: str | None = None):
    from peft import PeftModel
    return PeftModel.from_pretrained(HF_LOADERS[hf_key(family, task)](model_dir), adapter_dir,
                                     is_trainable=True).train()


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


def lora_mesh_vs_peft(family: str, model_dir, adapter_dir, plan, pp: int, dp: int, shares, batch_fn,
                      steps=5, lr=0.1, global_batch=8, num_microbatches=2, dp_sharding="none", task=None,
                      optimizer=None, dp_batch=None):
    """LoRA (started from adapter_dir) on a pp x dp x Galaxy mesh against peft's LoRA on Hugging
    Face's model, serially. Returns {"loss": per-step rel errors, "logits": step 0, "tensors":
    (worst rel error, key) of the adapter tensors, "grads": the same of their gradients at step 0,
    "frozen_grads": frozen parameters that got a gradient}. Without a pipeline the tensors are
    what the export writes (lora_adapter_state). task: the model's (None: the family's primary
    one); optimizer: parity_runners.optimizers' (None: torch's SGD; "sgd": galaxy's, which also
    takes a pipeline stage with nothing to train); dp_batch: rows per replica (None: even)."""
    # peft's model in float64: the exact gradients, so that the 1e-5 budget is galaxy's own rounding.
    # Against peft in fp32 two correct fp32 sums were measured 1.65e-5 apart (an AMD EPYC, the
    # Galaxy plan at heads 6 / 2, layer 1's q_proj lora_A gradient): peft's own fp32 gradient sits
    # 7.8e-6 from the exact one, galaxy's 9.2e-6, on opposite sides.
    ref = peft_reference(family, model_dir, adapter_dir, task).double()
    o = {**DEFAULTS, "pp": pp, "dp": dp, "steps": steps, "lr": lr, "global_batch": global_batch,
         "num_microbatches": num_microbatches, "dp_sharding": dp_sharding, "task": task, "optimizer": optimizer,
         "dp_batch": dp_batch, "adapt": lambda model: apply_peft(model, PeftOptions("lora", lora_path=adapter_dir), seed=0)}

    def frozen_grads(runner, mesh):
        return {"frozen_grads": [n for n, p in runner.model.named_parameters()
                                 if not p.requires_grad and p.grad is not None],
                "backward": getattr(runner, "backward", True),     # a pipeline stage runs one
                "grads": compare_tensors(lora_tensors(runner, family, grads=True), lora_grads(ref))}
    report = train_and_compare(model_dir, plan, shares, batch_fn, (hf_forward(ref), ref.parameters()), o,
                               frozen_grads)
    runner, _ = report.pop("runner"), report.pop("mesh")
    ours = lora_adapter_state(runner.model) if pp == 1 else lora_tensors(runner, family)
    report["tensors"] = compare_tensors(ours, reference_tensors(ref))
    return report


# The classifier heads a LoRA run trains beside its adapters (BERT's; BART's and T5's), as peft's
# modules_to_save does.
HEADS = ("classifier.", "classification_head.")


def lora_tensors(runner, family: str, grads: bool = False) -> dict[str, torch.Tensor]:
    """The trained tensors (LoRA's and the classifier head's), or their gradients, of every stage
    at full shape, by peft key."""
    to_hf = family_of(family).hf_names(runner.model.config)
    return {peft_key(to_hf(n)): t for n, t in runner.full_state(grads=grads).items()
            if ".lora_" in n or n.startswith(HEADS)}


def lora_grads(ref) -> dict[str, torch.Tensor]:
    """peft's trained tensors' gradients, by the keys its save_pretrained writes them under."""
    return {n.replace(".default.", ".").replace(".modules_to_save.", "."): p.grad
            for n, p in ref.named_parameters() if p.requires_grad}


def lora_plan_vs_peft(family: str, model_dir, adapter_dir, plan, shares, batch_fn, steps=5, lr=0.1, task=None):
    """lora_mesh_vs_peft for a Galaxy plan alone (pp 1 x dp 1), on batch_fn's own batch size."""
    return lora_mesh_vs_peft(family, model_dir, adapter_dir, plan, 1, 1, shares, batch_fn, steps, lr, None, 1,
                             task=task)


def lora_train_and_export(model_dir, adapter_dir, out_dir, merge, plan, shares, batch_fn, class_names):
    """2 SGD steps of LoRA (from adapter_dir) under `plan`, export_peft to out_dir (merged or as a
    peft directory); returns the logits of a held-out batch (seed 9), gathered to full length."""
    torch.manual_seed(0)
    group = world_group(*shares)
    model = build_model(model_dir, plan, group, num_labels=3)
    trainable = apply_peft(model, PeftOptions("lora", lora_path=adapter_dir), seed=0)
    sync, opt = GradientSync(model, group.pg), torch.optim.SGD(trainable.values(), lr=0.1)
    for step in range(2):
        model(**batch_fn(seed=step))[1].backward()
        sync()
        opt.step(), opt.zero_grad()
    export_peft(model, out_dir, base_model_path=model_dir, lead=group.rank == 0, merge=merge,
                class_names=class_names)
    with torch.no_grad():
        return full_sequence_logits(model, model.eval()(**batch_fn(seed=9))[0])


def record_layer_outputs(model) -> list:
    """A list that fills, as the model's layers run, with whether each layer's output needs a
    gradient (side-tuning runs the backbone without autograd; side-only never runs it)."""
    seen = []
    for layer in model.layers:
        layer.register_forward_hook(lambda mod, args, out: seen.append(out[0].requires_grad))
    return seen


def serial_group(shares) -> GalaxyGroup:
    """One rank holding every head, column and token (an encoder-decoder's decoder tokens too)."""
    return GalaxyGroup.serial(*(sum(s) for s in shares[:3]))


def _galaxy_peft(model_dir, plan, group, options, seed=0, task=None):
    model = build_model(model_dir, plan, group, num_labels=3, task=task)
    trainable = apply_peft(model, options, seed=seed)
    return model, trainable


def mesh_vs_serial(model_dir, plan, pp: int, dp: int, shares, options, batch_fn, steps=5, lr=0.5,
                   global_batch=8, num_microbatches=2, dp_sharding="none", task=None, stage_layers=None):
    """Adapters / side-tuning on a pp x dp x Galaxy mesh against galaxy serial (a one-rank group,
    whole batch), same seed. Returns {"loss", "logits" (step 0), "tensors": (worst, name) over
    the trained tensors}. task: the model's (None: the family's primary one); stage_layers: the
    pipeline's split (None: even)."""
    torch.manual_seed(0)
    ref, ref_trainable = _galaxy_peft(model_dir, plan, serial_group(shares), options, task=task)
    o = {**DEFAULTS, "pp": pp, "dp": dp, "steps": steps, "lr": lr, "global_batch": global_batch,
         "num_microbatches": num_microbatches, "dp_sharding": dp_sharding, "task": task,
         "stage_layers": stage_layers, "adapt": lambda model: apply_peft(model, options, seed=0)}
    report = train_and_compare(model_dir, plan, shares, batch_fn, (lambda batch: ref(**batch), ref.parameters()), o)
    runner, _ = report.pop("runner"), report.pop("mesh")
    full = runner.full_state()
    report["tensors"] = compare_tensors({n: full[n] for n in ref_trainable},
                                        {n: p.detach() for n, p in ref_trainable.items()})
    return report


def peft_plan_vs_serial(model_dir, plan, shares, options, batch_fn, steps=5, lr=0.5, task=None):
    """mesh_vs_serial for a Galaxy plan alone (pp 1 x dp 1), on batch_fn's own batch size."""
    return mesh_vs_serial(model_dir, plan, 1, 1, shares, options, batch_fn, steps, lr, None, 1, task=task)


def peft_cases_vs_serial(cases: list[dict]) -> list[dict]:
    """mesh_vs_serial for each case (its keyword arguments), in one call to a process pool."""
    return [mesh_vs_serial(**case) for case in cases]


def base_outputs_kept(model_dir, plan, shares, options, batch_fn, task=None, grad=True) -> bool:
    """At step 0 the PEFT model's logits equal the base model's bit for bit. grad False: both
    forwards without autograd (an evaluation's), where whether a weight or its input needs a
    gradient cannot steer a matmul to another kernel (T5's tied LM head: 1e-6 apart with autograd)."""
    group = world_group(*shares)
    base = build_model(model_dir, plan, group, num_labels=3, task=task)
    model, _ = _galaxy_peft(model_dir, plan, group, options, task=task)
    batch = batch_fn(seed=0)
    with torch.set_grad_enabled(grad):
        return torch.equal(base(**batch)[0], model(**batch)[0])
