"""Greedy generation equals HF generate under every plan (Llama; Qwen2 under two); causal-LM data
encodes as documented."""
import json

import pytest
import torch

from support.parity import HF_LOADERS, world_group

from galaxy.data.causal_lm import (IGNORE_INDEX, CausalLMBatches, encode_lm_sample, format_prompt,
                                   read_lm_samples)
from galaxy.data.errors import DataError
from galaxy.runtime.assemble import build_model
from galaxy.runtime.generate import greedy_generate
from galaxy.assets.tiny_llama import write_tiny_llama
from galaxy.assets.tiny_qwen2 import write_tiny_qwen2
from galaxy.plan import Plan

PAD = 24
PROMPT = "The for statement is used to"


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory):
    """lm_dir(family) -> its tiny model (galaxy.assets.tiny_*, BPE tokenizer), written once."""
    from safetensors.torch import load_file, save_file
    made = {}

    def get(family):
        if family not in made:
            write = {"llama": write_tiny_llama, "qwen2": write_tiny_qwen2}[family]
            path = write(str(tmp_path_factory.mktemp(f"tiny_{family}_tok")), vocab_size=512, seed=3)
            # A random model repeats itself quickly; sharpen it so greedy picks are far from ties
            # (the tiny Qwen2 ties the head to the embeddings: one tensor on disk).
            state = load_file(f"{path}/model.safetensors")
            state["lm_head.weight" if "lm_head.weight" in state else "model.embed_tokens.weight"] *= 8
            save_file(state, f"{path}/model.safetensors", metadata={"format": "pt"})
            made[family] = path
        return made[family]
    return get


@pytest.fixture(scope="module")
def llama_dir(lm_dir):
    return lm_dir("llama")


def generate_under(model_dir, att, mlp, con, shares):
    from transformers import AutoTokenizer
    group = world_group(*shares)
    model = build_model(model_dir, Plan(att, mlp, con), group)
    return greedy_generate(model, AutoTokenizer.from_pretrained(model_dir), PROMPT, 12, PAD)


def hf_generate(family, model_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    enc = tok(PROMPT, return_tensors="pt")
    out = HF_LOADERS[family](model_dir).eval().generate(**enc, max_new_tokens=12, do_sample=False)
    return out[0, enc["input_ids"].shape[1]:].tolist()


W2 = ((2, 2), (200, 144), (14, 10))     # query heads (whole K/V groups), MLP columns, tokens
W3 = ((4, 4, 4), (120, 120, 104), (9, 8, 7))   # heads unused: 2 K/V groups cannot cover 3 TP ranks


CASES = [("llama", 1, "TP", "TP", "SP", ((4,), (344,), (PAD,))), ("llama", 2, "TP", "TP", "SP", W2),
         ("llama", 2, "SP", "SP", "SP", W2), ("llama", 2, "TP", "SP", "None", W2), ("llama", 2, "SP", "TP", "None", W2),
         ("llama", 3, "SP", "TP", "SP", W3), ("qwen2", 2, "TP", "TP", "SP", W2), ("qwen2", 2, "SP", "SP", "None", W2)]


@pytest.mark.parametrize("family,world,att,mlp,con,shares", CASES,
                         ids=[f"{f}-w{w}-att{a}-mlp{m}-con{c}" for f, w, a, m, c, _ in CASES])
def test_greedy_generation_equals_hf(dist_pool, lm_dir, family, world, att, mlp, con, shares):
    model_dir = lm_dir(family)
    want = hf_generate(family, model_dir)
    assert len(want) == 12
    for rank, got in enumerate(dist_pool(world).run(generate_under, model_dir, att, mlp, con, shares)):
        assert got == want, f"rank {rank}: {got} != HF {want}"


def test_text_sample_labels_every_real_token(llama_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(llama_dir)
    ids, mask, labels = encode_lm_sample(tok, "for x in range(3): pass", None, PAD)
    n = len(tok("for x in range(3): pass")["input_ids"])
    assert mask.tolist() == [1] * n + [0] * (PAD - n)
    assert labels[:n].tolist() == ids[:n].tolist() and (labels[n:] == IGNORE_INDEX).all()


def test_instruction_sample_labels_only_the_response(llama_dir, tmp_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(llama_dir)
    path = tmp_path / "alpaca.jsonl"
    path.write_text(json.dumps({"instruction": "Name a loop.", "input": "", "output": "for"}) + "\n")
    (prompt, response), = read_lm_samples(str(path))
    assert prompt == format_prompt("Name a loop.") and response == "for"
    ids, mask, labels = encode_lm_sample(tok, prompt, response, 64)
    n_prompt = len(tok(prompt)["input_ids"])
    answer = tok("for", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert (labels[:n_prompt] == IGNORE_INDEX).all()
    assert labels[n_prompt:n_prompt + len(answer)].tolist() == answer
    assert (labels[n_prompt + len(answer):] == IGNORE_INDEX).all()


def test_bad_instruction_record_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"instruction": "x", "output": "y"}) + "\n" + json.dumps({"instruction": "x"}) + "\n")
    with pytest.raises(DataError, match=r"bad\.jsonl:2: 'output'"):
        read_lm_samples(str(path))


def test_lm_batches_shard_rows(llama_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(llama_dir)
    samples = [(f"sample number {i}", None) for i in range(8)]
    full = next(iter(CausalLMBatches(samples, tok, PAD, 4, shuffle=False)))
    half = next(iter(CausalLMBatches(samples, tok, PAD, 4, shuffle=False, shard=(1, 2))))
    for key in ("input_ids", "attention_mask", "labels"):
        assert torch.equal(half[key], full[key][2:4])
