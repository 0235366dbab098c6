"""Shape keys without model_path build a randomly initialised model of that shape and family:
transformers' own init after torch.manual_seed(seed), written once as a Hugging Face folder with
the family's default tokenizer, reused by every later run (and rank) with the same key."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from galaxy.config import ConfigError, load_config
from galaxy.models.random_init import ensure_model
from galaxy.models.registry import supported_model_types

SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2}


def config(tmp_path, **keys):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"pad_size": 32, **keys}))
    return load_config(path)


def test_bert_shape_is_hfs_init_under_the_seed(tmp_path, monkeypatch):
    from transformers import BertConfig, BertModel
    monkeypatch.chdir(tmp_path)
    cfg = ensure_model(config(tmp_path, **SHAPE, type_vocab_size=2, seed=7), "bert")
    assert cfg.model_path.startswith(str(tmp_path / "runs" / "random_init" / "bert-"))
    assert "randomly initialised bert model" in cfg._notes[-1] and "all-MiniLM-L6-v2 WordPiece" in cfg._notes[-1]
    assert "built in" in cfg._notes[-1] and "seed 7" in cfg._notes[-1]
    saved = json.load(open(os.path.join(cfg.model_path, "config.json")))
    assert {k: saved[k] for k in SHAPE} == SHAPE and saved["vocab_size"] == 30522 and saved["pad_token_id"] == 0
    torch.manual_seed(7)     # the reference: HF's BertModel drawn from the same seed
    want = BertModel(BertConfig(**SHAPE, vocab_size=30522, pad_token_id=0)).state_dict()
    got = load_file(os.path.join(cfg.model_path, "model.safetensors"))
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    again = ensure_model(config(tmp_path, **SHAPE, type_vocab_size=2, seed=7), "bert")
    assert again.model_path == cfg.model_path and "reused from" in again._notes[-1]
    other = ensure_model(config(tmp_path, **SHAPE, type_vocab_size=2, seed=8), "bert")
    assert other.model_path != cfg.model_path


def test_llama_shape_ships_the_tiny_llama_tokenizer(tmp_path, monkeypatch):
    from transformers import AutoTokenizer
    monkeypatch.chdir(tmp_path)
    cfg = ensure_model(config(tmp_path, model_type="llama", **SHAPE, type_vocab_size=2), None)
    saved = json.load(open(os.path.join(cfg.model_path, "config.json")))
    assert (saved["model_type"], saved["vocab_size"], saved["num_key_value_heads"]) == ("llama", 2048, 4)
    assert (saved["pad_token_id"], saved["bos_token_id"], saved["eos_token_id"]) == (0, 1, 2)
    assert "type_vocab_size" not in saved and cfg._ignored == ("type_vocab_size",)   # Llama has no token types
    assert len(AutoTokenizer.from_pretrained(cfg.model_path)) == 2048
    assert "tiny-llama byte-level BPE tokenizer" in cfg._notes[-1]


def test_bad_shapes_are_one_line_errors(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    msg = str(pytest.raises(ConfigError, ensure_model, config(tmp_path, **SHAPE, vocab_size=1000), "bert").value)
    assert msg.startswith("vocab_size 1000 is smaller than the 30522 tokens of the all-MiniLM-L6-v2")
    msg = str(pytest.raises(ConfigError, ensure_model, config(tmp_path, **SHAPE, model_type="xlnet"), "bert").value)
    assert msg.startswith(f"model_type 'xlnet' is not supported; supported: {', '.join(supported_model_types())}")
    big = {**SHAPE, "hidden_size": 16384, "intermediate_size": 65536, "num_hidden_layers": 48}
    msg = str(pytest.raises(ConfigError, ensure_model, config(tmp_path, **big), "bert").value)
    assert "B parameters: building it needs about" in msg and "lower hidden_size" in msg
    assert not [p for p in os.listdir(tmp_path / "runs" / "random_init") if not p.startswith(".")]
