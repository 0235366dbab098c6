"""Rank-side pieces of the generation tests: galaxy's KV-cached engine under a plan, and Hugging
Face's generate with its cache, on the same left-padded prompts."""
from __future__ import annotations

import torch

from galaxy.distributed.mesh import make_mesh
from galaxy.inference.model import eos_ids, generation_engine, generation_task
from galaxy.inference.replicas import cache_mib_per_rank, generate_all
from galaxy.inference.requests import Request
from galaxy.inference.sampling import Sampling
from galaxy.layers.kv_cache import open_caches
from galaxy.models.shape import read_model_shape
from galaxy.plan import Plan
from galaxy.runtime.assemble import build_model
from galaxy.runtime.runners import stage_of


def tokenizer_of(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


def requests_for(model_dir, prompts, max_new: int, sampling=Sampling(), **kw) -> list[Request]:
    tok = tokenizer_of(model_dir)
    return [Request(p, tuple(tok(p)["input_ids"]), max_new, sampling, **kw) for p in prompts]


def galaxy_generate(model_dir, plan: Plan, requests, rows_per_batch=8, lora=None, fold=False, eos=None,
                    token_sum=None):
    """[(tokens, finish_reason)] of every request on this rank, and this rank's cache MiB, under
    `plan` (resolved, its world the pool's). lora: (PeftOptions, seed) applied after the build;
    eos: the tokens that end a row instead of the model's; token_sum: the decode step's TP sum
    (galaxy.parallel.decode_layout) instead of the default."""
    engine = galaxy_engine(model_dir, plan, lora, fold, eos, token_sum)
    out = generate_all(engine, requests, rows_per_batch)
    return [(c.tokens, c.finish_reason) for c in out], cache_mib_per_rank(engine, torch.distributed.get_rank())


def galaxy_engine(model_dir, plan: Plan, lora=None, fold=False, eos=None, token_sum=None):
    """This rank's generation engine under `plan`, as galaxy_generate takes its arguments."""
    mesh = make_mesh(plan)
    model = build_model(model_dir, plan, mesh.galaxy, stage=stage_of(plan, mesh),
                        task=generation_task(read_model_shape(model_dir)))
    if lora is not None:
        from galaxy.peft import apply_peft
        from galaxy.peft.lora import fold_into_weights
        apply_peft(model, lora[0], seed=lora[1])
        if fold:
            fold_into_weights(model)
    tok = tokenizer_of(model_dir)
    engine = generation_engine(model, plan, mesh, tok)
    if eos is not None:
        engine.eos = frozenset(eos)
    if token_sum is not None:
        engine.token_sum = token_sum
    return engine


def galaxy_generate_cache_shapes(model_dir, plans, requests):
    """galaxy_generate's result under each of `plans` in one pool call, each with the [b, heads,
    slots, d] shapes of the caches this rank's engine opens for `requests` in one batch:
    (result, {"att": [per decoder layer], "xatt": [...]}) per plan (an encoder-decoder's)."""
    out = []
    for plan in plans:
        engine = galaxy_engine(model_dir, plan)
        result = [(c.tokens, c.finish_reason) for c in generate_all(engine, requests, len(requests))]
        m = engine.model
        caches = open_caches(m, len(requests), engine.prefill_length(max(len(r.ids) for r in requests)),
                             max(r.max_new_tokens for r in requests), torch.float32, "cpu")
        decoder = [layer for layer in m.layers if layer.sequence == "target"]
        shapes = {kind: [tuple(getattr(layer, kind).kv_cache.k.shape) for layer in decoder] for kind in ("att", "xatt")}
        caches.close()
        out.append(((result, cache_mib_per_rank(engine, torch.distributed.get_rank())), shapes))
    return out


def galaxy_generate_token_sums(model_dir, plan, requests, token_sums):
    """galaxy_generate under `plan` with each of `token_sums` in one pool call: [its result per sum]."""
    return [galaxy_generate(model_dir, plan, requests, token_sum=name) for name in token_sums]


def galaxy_generate_plans(model_dir, plans, requests, rows_per_batch: int = 8, eos=None):
    """galaxy_generate under each of `plans` in one pool call: [its result per plan]."""
    return [galaxy_generate(model_dir, plan, requests, rows_per_batch, eos=eos) for plan in plans]


def hf_generate(family, model_dir, prompts, max_new: int, eos=None, **beams) -> list[list[int]]:
    """Hugging Face generate(do_sample=False) with its cache on the left-padded batch: each row's
    new tokens up to and including its first EOS. eos: the tokens that end a row instead of the
    model's; beams: num_beams, length_penalty, early_stopping (beam search's best beam)."""
    from support.parity import HF_LOADERS
    tok = tokenizer_of(model_dir)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    enc = tok(list(prompts), return_tensors="pt", padding=True)
    model = HF_LOADERS[family](model_dir).eval()
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new, do_sample=False, pad_token_id=tok.pad_token_id,
                             **({} if eos is None else {"eos_token_id": list(eos)}), **beams)
    eos = set(eos_ids(model.config, tok) if eos is None else eos)
    rows = []
    for row in out[:, enc["input_ids"].shape[1]:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:cut])
    return rows


def galaxy_generate_runs(model_dir, runs, rows_per_batch: int = 8):
    """Each (plan, [requests, ...]) of `runs` in one pool call: [[(tokens, finish_reason)] per
    requests] per plan."""
    return [[galaxy_generate(model_dir, plan, requests, rows_per_batch)[0] for requests in cases]
            for plan, cases in runs]


def galaxy_generate_cases(model_dir, plans, cases, rows_per_batch: int = 8):
    """Every (requests, eos) case under each of `plans` in one pool call: [[(tokens, finish_reason)]
    per case] per plan."""
    return [[galaxy_generate(model_dir, plan, requests, rows_per_batch, eos=eos)[0] for requests, eos in cases]
            for plan in plans]
