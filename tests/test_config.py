"""galaxy.config: every error class gives one line naming the key, and the splits are right."""

import json

import pytest

from galaxy.config import ConfigError, apply_preset, load_config, resolved_plan, validate_for_world
from galaxy.models.shape import read_model_shape
from galaxy.plan import even_split


def validate(cfg, world, rank):
    """validate_for_world on the shape of the config's own model."""
    return validate_for_world(cfg, world, rank, read_model_shape(cfg.model_path))

BERT = {"model_type": "bert", "num_attention_heads": 6, "intermediate_size": 96,
        "hidden_size": 48, "num_hidden_layers": 2, "max_position_embeddings": 64}


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(BERT))
    return d


@pytest.fixture
def load(tmp_path, model_dir):
    """Write a config holding model_path plus `keys` and load it."""
    def _load(**keys):
        path = tmp_path / "config.json"
        path.write_text(json.dumps({"model_path": str(model_dir), "pad_size": 32, **keys}))
        return load_config(path)
    return _load


def error_of(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


# --- load_config -------------------------------------------------------------------------

def test_defaults_and_comment_keys_ignored(load, model_dir):
    cfg = load(_comment="why", _note=[1, 2])
    assert cfg.model_path == str(model_dir)
    assert (cfg.batch_size, cfg.optimizer, cfg.con_parallel_method, cfg.timeout_s) == (8, "adamw", "SP", 120.0)
    assert cfg.train_path is None and cfg.dropout is None and cfg._given == {"model_path", "pad_size"}


def test_unknown_key_suggests_nearest(load):
    assert error_of(load, learnig_rate=1e-4) == "unknown key 'learnig_rate'; did you mean 'learning_rate'?"


def test_wrong_type_names_key_expected_and_value(load):
    msg = error_of(load, learning_rate="fast")
    assert "learning_rate" in msg and "a number" in msg and '"fast"' in msg
    assert "seq_scatter_list[1]" in error_of(load, seq_scatter_list=[16, "16"])


def test_bool_is_not_an_int_but_int_is_a_float(load):
    assert "pad_size must be an integer, got true" in error_of(load, pad_size=True)
    assert load(learning_rate=1).learning_rate == 1.0


def test_bad_enum_lists_valid_values(load):
    msg = error_of(load, optimizer="adam")
    assert "optimizer" in msg and "'sgd', 'adamw'" in msg


def test_ranges(load):
    assert "batch_size" in error_of(load, batch_size=0)
    assert "learning_rate" in error_of(load, learning_rate=0)
    assert "weight_decay" in error_of(load, weight_decay=-0.1)
    assert "dropout" in error_of(load, dropout=1.0)
    assert "timeout_s" in error_of(load, timeout_s=0)
    assert "tp_intermediate_size_list[1]" in error_of(load, tp_intermediate_size_list=[96, 0])


def test_null_con_method_is_stored_as_none_string(load):
    assert load(con_parallel_method=None).con_parallel_method == "None"
    assert load(con_parallel_method="None").con_parallel_method == "None"


def test_bad_json_reports_line_and_column(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{\n  "pad_size": 32,\n}\n')
    msg = error_of(load_config, path)
    assert "line 3 column 1" in msg
    assert "not found" in error_of(load_config, tmp_path / "missing.json")
    path.write_text("[1]")
    assert "JSON object" in error_of(load_config, path)


def test_missing_model_dir(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"model_path": str(tmp_path / "nope")}))
    assert "model_path" in error_of(load_config, path)
    (tmp_path / "empty").mkdir()
    path.write_text(json.dumps({"model_path": str(tmp_path / "empty")}))
    assert "has no config.json" in error_of(load_config, path)
    path.write_text("{}")
    assert "model_path is required" in error_of(load_config, path)


def test_missing_data_file(load, tmp_path):
    assert "dev_path" in error_of(load, dev_path=str(tmp_path / "dev.txt"))


def test_relative_paths_resolve_from_cwd(load, tmp_path, monkeypatch):
    (tmp_path / "train.txt").write_text("a\t0\n")
    monkeypatch.chdir(tmp_path)
    assert load(train_path="train.txt").train_path == str(tmp_path / "train.txt")


def test_class_list_from_file(load, tmp_path):
    (tmp_path / "class.txt").write_text("finance\n\nsports\n")
    assert load(class_list=str(tmp_path / "class.txt")).class_list == ["finance", "sports"]
    assert load(class_list=["a", "b"]).class_list == ["a", "b"]
    assert "class_list" in error_of(load, class_list=str(tmp_path / "none.txt"))
    assert "class_list" in error_of(load, class_list=["a", "a"])


# --- splits and validate_for_world --------------------------------------------------------

def test_even_split():
    assert even_split(12, 5) == [3, 3, 2, 2, 2]
    assert even_split(128, 2) == [64, 64]
    assert even_split(8, 3, unit=2) == [4, 2, 2]
    with pytest.raises(ValueError):
        even_split(2, 3)


def test_resolved_plan_defaults_and_given(load, model_dir):
    assert read_model_shape(model_dir)["num_key_value_heads"] == 6
    cfg = load(seq_scatter_list=[20, 12])
    plan = resolved_plan(cfg, 2, read_model_shape(cfg.model_path))
    assert (plan.heads, plan.columns, plan.tokens, plan.stages) == ((3, 3), (48, 48), (20, 12), (2,))
    assert plan.to_keys()["seq_scatter_list"] == [20, 12]


def test_model_shape_of_a_family_with_its_own_key_names(tmp_path):
    """GPT-2's config.json says n_embd, n_head, n_layer, n_positions, n_inner (None: 4 x n_embd);
    the plan checks read them under the standard names, and unsupported options fail in one line."""
    d = tmp_path / "gpt2"
    d.mkdir()
    gpt2 = {"model_type": "gpt2", "n_embd": 48, "n_head": 4, "n_layer": 2, "n_positions": 64, "n_inner": None}
    (d / "config.json").write_text(json.dumps(gpt2))
    shape = read_model_shape(d)
    assert {k: shape[k] for k in ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size",
                                  "max_position_embeddings", "num_key_value_heads")} == \
        {"hidden_size": 48, "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 192,
         "max_position_embeddings": 64, "num_key_value_heads": 4}
    (d / "config.json").write_text(json.dumps({**gpt2, "reorder_and_upcast_attn": True}))
    assert "reorder_and_upcast_attn" in error_of(read_model_shape, d)


def test_rank_out_of_range(load):
    assert error_of(validate, load(), 2, 2) == "--rank 2 is out of range for --world 2; use 0..1"


def test_world_not_divisible_by_pp_dp(load):
    msg = error_of(validate, load(dp_deg=2), 3, 0)
    assert "--world 3" in msg and "dp_deg 2" in msg
    assert "batch_size" in error_of(validate, load(dp_deg=3, batch_size=8), 3, 0)


def test_dp_sharding_needs_replicas(load):
    assert error_of(validate, load(dp_sharding="full"), 2, 0) == (
        "dp_sharding is 'full' but dp_deg is 1: it shards the data-parallel replicas' parameters over "
        "dp_deg > 1 replicas; set dp_deg or remove dp_sharding")
    validate(load(dp_sharding="no_reshard", dp_deg=2), 2, 0)
    assert "dp_sharding must be one of 'none', 'full', 'no_reshard'" in error_of(load, dp_sharding="zero3")


def test_cpu_allocator_names(load):
    assert load(cpu_allocator="system").cpu_allocator == "system"
    assert "cpu_allocator must be one of 'keep', 'system'" in error_of(load, cpu_allocator="jemalloc")


def test_split_list_wrong_length(load):
    msg = error_of(validate, load(seq_scatter_list=[10, 10, 12]), 2, 0)
    assert msg == ("seq_scatter_list has 3 entries but the Galaxy group has 2 ranks "
                   "(world 2 / (pp_deg 1 x dp_deg 1))")


def test_split_list_wrong_sum(load):
    msg = error_of(validate, load(tp_num_attention_heads_list=[4, 3]), 2, 0)
    assert "tp_num_attention_heads_list sums to 7" in msg and "6" in msg


def test_default_head_split_impossible(load):
    msg = error_of(validate, load(), 8, 0)  # 6 heads over 8 ranks
    assert msg.startswith("tp_num_attention_heads_list is omitted") and "at most 6 ranks" in msg
    validate(load(att_parallel_method="SP"), 8, 0)  # SP attention does not split heads


def test_pad_size_beyond_positions(load):
    assert "pad_size" in error_of(validate, load(pad_size=65), 1, 0)


def test_gqa_heads_must_be_whole_kv_groups(tmp_path):
    model = tmp_path / "llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**BERT, "model_type": "llama",
                                                   "num_attention_heads": 8, "num_key_value_heads": 4}))
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"model_path": str(model), "pad_size": 32,
                                "tp_num_attention_heads_list": [3, 5]}))
    assert "tp_num_attention_heads_list[0] is 3, not a multiple of 2" in error_of(
        validate, load_config(path), 2, 0)
    path.write_text(json.dumps({"model_path": str(model), "pad_size": 32}))
    cfg = load_config(path)
    assert resolved_plan(cfg, 3, read_model_shape(cfg.model_path)).heads == (4, 2, 2)
    assert "4 KV groups" in error_of(validate, cfg, 5, 0)


# --- presets ------------------------------------------------------------------------------

def test_preset_sets_methods_left_at_default(load):
    cfg = apply_preset(load(), "tp", "pretrain_tp_bert.py")
    assert (cfg.att_parallel_method, cfg.con_parallel_method, cfg.mlp_parallel_method) == ("TP", "None", "TP")
    assert apply_preset(load(), "sp").mlp_parallel_method == "SP"
    cfg = apply_preset(load(att_parallel_method="SP"), "galaxy")
    assert cfg.att_parallel_method == "SP" and cfg.preset == "galaxy"


def test_preset_conflict_names_key(load):
    msg = error_of(apply_preset, load(att_parallel_method="SP"), "tp", "pretrain_tp_bert.py")
    assert msg == ("att_parallel_method is 'SP' but pretrain_tp_bert.py runs ATT TP; "
                   "remove the key or use pretrain_galaxy.py")


def test_serial_preset_needs_world_one(load):
    cfg = apply_preset(load(), "serial", "pretrain_serial.py")
    validate(cfg, 1, 0)
    assert "pretrain_serial.py runs on one process" in error_of(validate, cfg, 2, 0)
