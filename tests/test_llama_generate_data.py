"""Causal-LM data encodes as documented (generation under every plan: test_generate_plans.py)."""
import json

import pytest
import torch

from galaxy.data.causal_lm import (IGNORE_INDEX, CausalLMBatches, encode_lm_sample, format_prompt,
                                   read_lm_samples)
from galaxy.data.errors import DataError

PAD = 24


@pytest.fixture(scope="module")
def llama_dir(sharp_lm):
    return sharp_lm("llama")


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
