"""profile_flops.py as users run it: serial tiny BERT with --json, and one-line errors."""
import json
from argparse import Namespace

import pytest

from support.script_runner import run_script
from support.tiny_models import TINY_BERT

from galaxy.config import ConfigError, load_config
from galaxy.profiler import bert_matmul_flops
from galaxy.launch import parse_args
from galaxy.profiler.cli import SCRIPT, add_arguments, prepare


def write_config(tmp_path, model_dir, **extra):
    cfg = dict(model_path=model_dir, pad_size=10, batch_size=3, dropout=0.0, class_list=["a", "b", "c"], **extra)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_serial_json(tmp_path, tiny_bert_dir):
    out = tmp_path / "report.json"
    # on a command driver (support.script_runner): run as `python profile_flops.py ...`, torch imported once
    stdout, = run_script("profile_flops.py", write_config(tmp_path, tiny_bert_dir), 1, "--model", "bert",
                         "--json", str(out), "--repeats", "1", "--depth", "1")
    expected = bert_matmul_flops(batch=3, seq=10, hidden=TINY_BERT["hidden_size"], intermediate=TINY_BERT[
        "intermediate_size"], layers=TINY_BERT["num_hidden_layers"], num_labels=3)["total"]
    doc = json.loads(out.read_text())
    assert doc["totals"]["fwd_flops"] == expected == doc["closed_form"]["fwd_flops"]
    assert doc["totals"]["bwd_flops"] == 2 * expected
    assert len(doc["sub_blocks"]) == 4 * TINY_BERT["num_hidden_layers"] and len(doc["ranks"]) == 1
    assert "(exact)" in stdout and "CON (con1)" in stdout and "element-wise" in stdout


def test_wrong_family_is_a_config_error(tmp_path, tiny_bert_dir):
    opts = parse_args(["--model", "llama", "--config_file", "c.json", "--world", "2"], SCRIPT, add_arguments)
    assert (opts.model, opts.world, opts.repeats, opts.compare_deepspeed) == ("llama", 2, 3, False)
    with pytest.raises(ConfigError, match="--model llama but model_path holds a 'bert' model"):
        prepare(load_config(write_config(tmp_path, tiny_bert_dir)), opts)


def test_compare_deepspeed_needs_deepspeed(tmp_path, tiny_bert_dir, monkeypatch):
    import importlib.util
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    opts = Namespace(model="bert", compare_deepspeed=True, repeats=1, warmup=1, depth=3)
    with pytest.raises(ConfigError, match="deepspeed"):
        prepare(load_config(write_config(tmp_path, tiny_bert_dir)), opts)
