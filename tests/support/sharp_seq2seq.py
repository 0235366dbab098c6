"""A tiny BART or T5 whose greedy picks are far from ties, and Hugging Face's generate on it.

galaxy.assets' tiny encoder-decoders (and T5 in the v1.1 form) with a 512-token BPE (seed 3), every matrix but BART's
learned positions scaled by 25: at the default init (std 0.02) their outputs barely depend on
the prompt and every row repeats one token; scaled, the rows differ and the smallest gap between
the two best logits stays above 1e-2, a thousand times fp32's rounding under any plan. T5's
relative position tables are scaled by 100 more: beside the scaled scores the bias would
otherwise change no greedy pick, and a wrong bias for a cached position would go unseen.
`eos_token_id` is set to a token the model picks inside some rows (config.json only), so rows
of one batch stop at different steps, as Hugging Face's generate stops them too.
"""
from __future__ import annotations

import json
import os

import torch

SCALE = 25.0
BIAS_SCALE = 100.0       # T5's relative_attention_bias, on top of SCALE
EOS = {"bart": 121, "t5": 434, "t5_v1_1": 231}   # a token the greedy rows of PROMPTS pick at step 2 or 3 of one row


def write_t5_v1_1(path: str, vocab_size: int, seed: int) -> str:
    """The tiny T5 in the v1.1 form: gated-GELU MLP, an LM head of its own (untied, unscaled)."""
    from safetensors.torch import load_file, save_file
    from transformers import T5Config, T5ForConditionalGeneration

    from galaxy.assets.tiny_llama import SPECIAL, train_bpe, write_tiny_model
    from galaxy.assets.tiny_t5 import TINY_T5_SHAPE, t5_tokenizer
    shape = {**TINY_T5_SHAPE, "feed_forward_proj": "gated-gelu"}
    write_tiny_model(path, lambda **keys: T5ForConditionalGeneration(T5Config(**keys)), vocab_size, seed,
                     tokenizer=lambda n: t5_tokenizer(train_bpe(n, SPECIAL)), shape=shape)
    weights = os.path.join(path, "model.safetensors")
    state = load_file(weights)
    state["lm_head.weight"] = 0.02 * torch.randn(state["shared.weight"].shape,
                                                 generator=torch.Generator().manual_seed(seed))
    save_file(state, weights, metadata={"format": "pt"})
    _edit_config(path, tie_word_embeddings=False)
    return path


def _edit_config(path: str, **keys) -> None:
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config.update(keys)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def write_sharp_seq2seq(family: str, path: str) -> str:
    """family: bart, t5 or t5_v1_1."""
    from safetensors.torch import load_file, save_file

    from galaxy.assets.tiny_bart import write_tiny_bart
    from galaxy.assets.tiny_t5 import write_tiny_t5
    writers = {"bart": write_tiny_bart, "t5": write_tiny_t5, "t5_v1_1": write_t5_v1_1}
    path = writers[family](path, vocab_size=512, seed=3)
    weights = os.path.join(path, "model.safetensors")
    state = load_file(weights)
    for name, t in state.items():
        if t.ndim == 2 and "embed_positions" not in name:
            state[name] = t * SCALE * (BIAS_SCALE if "relative_attention_bias" in name else 1.0)
    save_file(state, weights, metadata={"format": "pt"})
    for name in ("config.json", "generation_config.json"):
        with open(os.path.join(path, name)) as f:
            config = json.load(f)
        config["eos_token_id"] = EOS[family]
        config.pop("forced_eos_token_id", None)
        with open(os.path.join(path, name), "w") as f:
            json.dump(config, f, indent=2)
    return path


def hf_seq2seq_generate(model_dir: str, prompts, max_new: int, adapter: str | None = None, eos=None,
                        num_beams: int = 1, **beams) -> list[list[int]]:
    """Hugging Face's plain greedy generate with its cache on the right-padded batch (no forced
    tokens, no n-gram or length rules, one beam): each row's tokens after the start token, up to
    and including its first EOS. adapter: a peft LoRA folder applied to the model; eos: the tokens
    that end a row instead of the model's; num_beams and beams (length_penalty, early_stopping):
    beam search's best beam."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    enc = tok(list(prompts), return_tensors="pt", padding=True)
    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir).eval()
    if adapter is not None:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, adapter).eval()
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new, do_sample=False, num_beams=num_beams, min_length=0,
                             no_repeat_ngram_size=0, forced_bos_token_id=None, forced_eos_token_id=None,
                             repetition_penalty=1.0, use_cache=True,
                             **({} if eos is None else {"eos_token_id": list(eos)}), **beams)
    eos = {model.config.eos_token_id} if eos is None else set(eos)
    rows = []
    for row in out[:, 1:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:cut])
    return rows
