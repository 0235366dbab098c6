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


BART_SHAPE = {"d_model": 32, "encoder_layers": 1, "decoder_layers": 2, "encoder_attention_heads": 4,
              "encoder_ffn_dim": 64}
T5_SHAPE = {"d_model": 32, "num_layers": 1, "num_decoder_layers": 2, "num_heads": 4, "d_kv": 8, "d_ff": 64}


@pytest.mark.parametrize("family,shape", [("bart", BART_SHAPE), ("t5", T5_SHAPE)])
def test_encoder_decoder_shape_keys_build_hfs_seq2seq_model(tmp_path, monkeypatch, family, shape):
    """Galaxy-LM's bart / t5 keys: the decoder's heads and MLP follow the encoder's (BART), the
    decoder starts with the pad token (T5's <pad>), and the weights are HF's own init under the
    seed; keys of the other family are ignored."""
    from transformers import AutoConfig, AutoModelForSeq2SeqLM, AutoTokenizer
    monkeypatch.chdir(tmp_path)
    other = {"d_kv": 8} if family == "bart" else {"encoder_layers": 2}
    cfg = ensure_model(config(tmp_path, **shape, **other, seed=3), family)
    note = cfg._notes[-1]
    assert f"randomly initialised {family} model" in note and f"tiny-{family} byte-level BPE" in note
    assert cfg._ignored == tuple(other)
    saved = json.load(open(os.path.join(cfg.model_path, "config.json")))
    assert {k: saved[k] for k in shape} == shape and saved["vocab_size"] == 2048
    if family == "bart":
        assert (saved["decoder_attention_heads"], saved["decoder_ffn_dim"]) == (4, 64)
        assert (saved["pad_token_id"], saved["eos_token_id"], saved["decoder_start_token_id"]) == (0, 2, 2)
    else:
        assert (saved["pad_token_id"], saved["eos_token_id"], saved["decoder_start_token_id"]) == (0, 2, 0)
    assert len(AutoTokenizer.from_pretrained(cfg.model_path)) == 2048
    torch.manual_seed(3)
    want = AutoModelForSeq2SeqLM.from_config(AutoConfig.from_pretrained(cfg.model_path)).state_dict()
    got = load_file(os.path.join(cfg.model_path, "model.safetensors"))
    assert all(torch.equal(got[k], want[k]) for k in got) and len(got) > 10


@pytest.mark.parametrize("key", ("decoder_start_token_id", "pad_token_id"))
def test_t5_config_without_start_or_pad_id_is_one_line(tmp_path, key):
    """No AttributeError at the first forward: read_model_shape names the key, before any process group."""
    from galaxy.models.shape import read_model_shape
    raw = {"model_type": "t5", "d_model": 32, "num_layers": 1, "num_heads": 4, "d_kv": 8, "d_ff": 64,
           "decoder_start_token_id": 0, "pad_token_id": 0}
    del raw[key]
    if key == "pad_token_id":
        raw[key] = None         # T5Config's default is 0: only an explicit null leaves it unset
    (tmp_path / "config.json").write_text(json.dumps(raw))
    msg = str(pytest.raises(ConfigError, read_model_shape, str(tmp_path)).value)
    assert msg.startswith(f"model_path config '{tmp_path}/config.json': config.json has no {key}; T5 starts the "
                          "decoder with decoder_start_token_id"), msg
