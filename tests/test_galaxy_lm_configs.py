"""Galaxy-LM's config files load: hand-written configs in its style (its keys, its layout, no
model_path; small shapes) map to this project's keys, with one note line for what was mapped and
one warning line naming the keys ignored; a config with several mistakes reports them all."""
import json
import os
from argparse import Namespace

import pytest

from support.galaxy_lm_style import (BART_PP_FULL, BERT_FULL, BERT_GALAXY_LORA, BERT_LORA, BERT_PP_SIDE, LLAMA_FULL,
                                     LLAMA_PP_FULL, T5_PP_FULL)

from galaxy.config import ConfigError, apply_preset, load_config, validate_for_world
from galaxy.launch import load_run_config, main
from galaxy.models.shape import read_model_shape

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write(tmp_path, name, keys) -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(keys, indent=4))
    return str(path)


def test_bert_full(tmp_path):
    cfg = load_config(write(tmp_path, "full", BERT_FULL))
    assert cfg.model_path is None and (cfg.hidden_size, cfg.num_hidden_layers, cfg.batch_size) == (64, 2, 4)
    assert cfg._notes == ("Galaxy-LM keys: train true (training)",) and cfg._ignored == () and cfg.train


def test_bert_lora_maps_and_ignores(tmp_path):
    cfg = load_config(write(tmp_path, "lora", BERT_LORA))
    assert (cfg.use_lora, cfg.lora_dim, cfg.lora_alpha, cfg.lora_dropout) == (True, 8, 32.0, 0.1)
    assert cfg._ignored == ("fan_in_fan_out", "merge_weights")


def test_bert_galaxy_lora_keeps_the_plan_and_the_rendezvous(tmp_path):
    cfg = load_config(write(tmp_path, "galaxy_lora", BERT_GALAXY_LORA))
    assert (cfg.con_parallel_method, cfg.tp_num_attention_heads_list, cfg.seq_scatter_list) == ("None", [2, 2], [20, 12])
    assert cfg.init_method == "tcp://127.0.0.1:23000" and cfg.distributed_backend == "gloo"
    assert "init_method -> the --init_method default" in cfg._notes[0]


def test_bert_pp_side_runs_its_single_micro_batch_under_gpipe(tmp_path):
    cfg = load_config(write(tmp_path, "pp_side", BERT_PP_SIDE))
    assert cfg.max_steps == 1 and cfg.use_side and cfg._ignored == ("add_bias_sampling",)
    assert "num_iterations -> max_steps" in cfg._notes[0]
    cfg = apply_preset(cfg, "pp", "pretrain_pp_bert.py", world=2)
    assert (cfg.pp_deg, cfg.pipeline_schedule) == (2, "gpipe") and "pipeline_schedule gpipe" in cfg._notes[-1]


@pytest.mark.parametrize("keys", [LLAMA_FULL, LLAMA_PP_FULL], ids=["full", "pp_full"])
def test_llama_configs(tmp_path, keys):
    cfg = load_config(write(tmp_path, "llama", keys))
    assert (cfg.model_type, cfg.lora_dim, cfg.vocab_size, cfg.type_vocab_size) == ("llama", 4, 2048, 2)
    assert "lora_att_dim -> lora_dim" in cfg._notes[0] and "device cuda" in cfg._notes[0]
    assert cfg._ignored == ("fan_in_fan_out", "merge_weights")


def test_t5_pp_takes_hugging_face_sizes_and_counts_both_stacks(tmp_path, monkeypatch):
    """Its T5 pipeline file: T5's size keys are shape keys here, checked against model_path's
    config.json; the stage split counts 2 + 2 layers; T5's other keys (model_path's config.json has
    them) and its THUCNews files are ignored."""
    monkeypatch.chdir(ROOT)
    cfg = load_config(write(tmp_path, "t5_pp", T5_PP_FULL))
    assert "dropout_rate -> dropout" in cfg._notes[0], cfg._notes
    assert (cfg.d_model, cfg.num_layers, cfg.num_decoder_layers, cfg.num_heads, cfg.d_ff) == (64, 2, 2, 4, 128)
    assert {"relative_attention_num_buckets", "vocab_path", "class_list_path", "use_cache"} <= set(cfg._ignored)
    msg = str(pytest.raises(ConfigError, load_config, write(tmp_path, "wide", {**T5_PP_FULL, "d_model": 128})).value)
    assert msg.startswith("d_model is 128 (integer) in the config but 64 (integer) in model_path's"), msg
    cfg = apply_preset(cfg, "pp", "finetune_pp_t5.py", world=2)
    assert (cfg.pp_deg, cfg.stage_num_hidden_layers_list, cfg.num_microbatches, cfg.max_steps) == (2, [2, 2], 4, 1)
    validate_for_world(cfg, 2, 0, read_model_shape(cfg.model_path))


def test_bart_pp_counts_encoder_and_decoder_layers(tmp_path):
    cfg = load_config(write(tmp_path, "bart_pp", BART_PP_FULL))
    assert (cfg.d_model, cfg.encoder_ffn_dim, cfg.encoder_attention_heads, cfg.encoder_layers,
            cfg.decoder_layers) == (64, 128, 4, 3, 3)
    assert cfg.num_hidden_layers is None and "num_hidden_layers: BART's alias of encoder_layers" in cfg._notes[0]
    problems = pytest.raises(ConfigError, load_config, write(tmp_path, "bad", {
        **BART_PP_FULL, "decoder_attention_heads": 8, "num_hidden_layers": 2})).value.problems
    assert problems[:2] == ["decoder_attention_heads 8 differs from encoder_attention_heads 4; galaxy splits one "
                            "size over both stacks: make them equal",
                            "num_hidden_layers 2 and encoder_layers 3 differ; remove num_hidden_layers"]


def test_shape_keys_must_agree_with_model_path(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 128, "num_hidden_layers": 4}))
    msg = str(pytest.raises(ConfigError, load_config,
                            write(tmp_path, "c", {**LLAMA_FULL, "model_path": str(model)})).value)
    lines = msg.splitlines()
    assert any(line.startswith("hidden_size is 64 (integer) in the config but 128 (integer) in model_path's")
               for line in lines), lines
    assert any(line.startswith("num_hidden_layers is 2") for line in lines)
    ok = {"model_path": str(model), "model_type": "llama", "hidden_size": 128, "type_vocab_size": 2}
    cfg = load_config(write(tmp_path, "ok", ok))
    assert cfg.type_vocab_size is None and cfg._ignored == ("type_vocab_size",)   # Llama has no token types


def test_several_mistakes_are_reported_together(tmp_path):
    bad = {**BERT_FULL, "batch_size": 0, "learnig_rate": 1e-4, "optimizer": "adam", "use_lora": True,
           "lora_att_dim": 4, "lora_dim": 8, "train_path": str(tmp_path / "none.tsv")}
    problems = pytest.raises(ConfigError, load_config, write(tmp_path, "bad", bad)).value.problems
    assert problems[0].startswith("lora_att_dim 4 (Galaxy-LM's name for lora_dim) and lora_dim 8 are both set")
    assert "unknown key 'learnig_rate'; did you mean 'learning_rate'?" in problems
    assert any(p.startswith("optimizer must be one of") for p in problems)
    assert "batch_size must be at least 1, got 0" in problems
    assert any(p.startswith("use_lora and full_model") or "full_model and use_lora are all true" in p
               for p in problems), problems
    assert any(p.startswith("train_path") for p in problems)
    assert len(problems) == 6


def test_entry_script_prints_one_line_per_problem_and_exits_2(tmp_path, capsys):
    bad = write(tmp_path, "bad", {**BERT_FULL, "batch_size": 0, "pad_size": "long", "fan_in_fan_out": True})
    with pytest.raises(SystemExit) as info:
        main(preset="serial", train_fn=None, script="pretrain_bert.py", argv=["--config", bad])
    assert info.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["pretrain_bert.py: error: pad_size must be an integer, got \"long\" (string)",
                   "pretrain_bert.py: error: batch_size must be at least 1, got 0"]


def test_world_problems_are_reported_together(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "bert", "num_attention_heads": 4,
                                                   "intermediate_size": 128, "hidden_size": 64,
                                                   "num_hidden_layers": 2, "max_position_embeddings": 64}))
    cfg = load_config(write(tmp_path, "c", {"model_path": str(model), "pad_size": 128, "seq_scatter_list": [1, 2, 3],
                                            "tp_num_attention_heads_list": [1, 1]}))
    problems = pytest.raises(ConfigError, validate_for_world, cfg, 2, 0, read_model_shape(cfg.model_path)).value.problems
    assert [p.split()[0] for p in problems] == ["tp_num_attention_heads_list", "seq_scatter_list", "pad_size"]


def test_config_init_method_is_the_command_line_default(tmp_path, monkeypatch):
    """Galaxy-LM kept the rendezvous address in the config: it is --init_method's default here."""
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, "g", BERT_GALAXY_LORA)
    args = Namespace(config_file=path, config_defaulted=False, max_steps=2, max_eval_samples=None, world=2,
                     rank=1, init_method="tcp://127.0.0.1:29500", init_method_defaulted=True)
    cfg = load_run_config(args, "galaxy", "pretrain_galaxy.py", "bert")
    assert args.init_method == "tcp://127.0.0.1:23000" and cfg.max_steps == 2
    assert cfg.model_path.startswith(str(tmp_path / "runs" / "random_init" / "bert-"))
    args.init_method_defaulted, args.init_method = False, "tcp://10.0.0.1:1234"
    load_run_config(args, "galaxy", "pretrain_galaxy.py", "bert")
    assert args.init_method == "tcp://10.0.0.1:1234"                          # the command line wins


def test_default_config_outside_the_repository_is_a_one_line_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(preset="serial", train_fn=None, script="pretrain_bert.py", argv=[],
             default_config="train_config/bert/full.json", model_type="bert")
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"pretrain_bert.py: error: no --config_file given and the default train_config/bert/full.json is not "
        f"in the current directory {str(tmp_path)!r}; run from the repository root or give --config_file"]
