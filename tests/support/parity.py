"""Rank-side pieces of the fidelity tests: Hugging Face references, errors, report checks.

The one loop that trains galaxy and a reference side by side is parity_runners.train_and_compare."""
from __future__ import annotations

import torch
import torch.distributed as dist


from galaxy.distributed.group import GalaxyGroup
from galaxy.models.registry import family_of
from galaxy.plan import Plan


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to max |b| (the scale of the reference tensor)."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def mesh_of(pp: int, dp: int, heads, columns, tokens, **plan):
    """The mesh of a pp x dp x Galaxy-group plan with these shares (collective), and that plan."""
    from galaxy.distributed.mesh import make_mesh
    plan = Plan(pp=pp, dp=dp, heads=tuple(heads), columns=tuple(columns), tokens=tuple(tokens), **plan)
    return make_mesh(plan)


def world_group(heads, inter, seq, decoder=None) -> GalaxyGroup:
    """The whole world as one Galaxy group with these shares (decoder: an encoder-decoder's
    decoder token shares)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    return GalaxyGroup(rank, world, dist.group.WORLD if world > 1 else None,
                       tuple(heads), tuple(inter), tuple(seq), decoder_tokens=tuple(decoder) if decoder else None)


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
    if not grads:     # weights Hugging Face keeps as buffers (BART's final_logits_bias)
        ref.update({n: b for n, b in hf_model.named_buffers() if n in ref or n.endswith("logits_bias")})
    floor = 1e-3 * max(t.abs().max().item() for t in ref.values())
    worst, where = 0.0, ""
    for name, t in galaxy_full.items():
        hf = to_hf(name)
        t, r = spec.hf_state(hf_model.config, {name: t})[hf], ref[hf]
        err = ((t - r).abs().max() / max(r.abs().max().item(), floor)).item()
        if err > worst:
            worst, where = err, name
    return worst, where


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


def hf_bart(model_dir):
    from transformers import BartForConditionalGeneration
    return BartForConditionalGeneration.from_pretrained(model_dir).train()


def hf_t5(model_dir):
    from transformers import T5ForConditionalGeneration
    return T5ForConditionalGeneration.from_pretrained(model_dir).train()


def hf_bart_classifier(model_dir):
    from transformers import BartForSequenceClassification
    return BartForSequenceClassification.from_pretrained(model_dir).train()


def hf_t5_classifier(model_dir):
    from transformers import T5ForSequenceClassification
    return T5ForSequenceClassification.from_pretrained(model_dir).train()


HF_LOADERS = {"bert": hf_bert, "llama": hf_llama, "qwen2": hf_qwen2, "gpt2": hf_gpt2,
              "llama/classification": hf_llama_classifier, "bart": hf_bart, "t5": hf_t5,
              "bart/classification": hf_bart_classifier, "t5/classification": hf_t5_classifier}


def check_report(report, rank, tol=1e-5):
    assert report["logits"] < tol, f"rank {rank}: logits off by {report['logits']}"
    assert max(report["loss"]) < tol, f"rank {rank}: losses off by {report['loss']}"
    assert report["grad"][0] < tol, f"rank {rank}: gradient of {report['grad'][1]} off by {report['grad'][0]}"
    if "grad_norm" in report:
        assert report["grad_norm"] < tol, f"rank {rank}: gradient norm off by {report['grad_norm']}"
    assert report["weights"][0] < tol, f"rank {rank}: weight {report['weights'][1]} off by {report['weights'][0]}"


def check_labelled_reports(ranks, labels, tol=1e-5):
    """ranks: per rank, one report per case (or (anything, report) pairs); labels: the cases'
    names, which an assertion's message starts with."""
    for rank, reports in enumerate(ranks):
        for label, report in zip(labels, reports):
            try:
                check_report(report[1] if isinstance(report, tuple) else report, rank, tol)
            except AssertionError as e:
                raise AssertionError(f"{label}: {e}") from None
