"""Galaxy-LM's config keys, translated to this project's.

Galaxy-LM (the research code this project grew from) kept its settings in JSON files read over
Python defaults; users arrive with those files. `translate(raw)` turns such a dict into this
project's keys before galaxy.config checks them, and says what it did:

  same name, same meaning   passed through untouched (batch_size, pad_size, num_epochs, the
                            plan and pipeline keys, the PEFT flags, lora_dim, ...)
  renamed or reinterpreted  MAPPED below; one note line lists them
  no meaning here           IGNORED below; one warning line names them all
  anything else             passed through, so galaxy.config reports it as an unknown key

Shape keys (hidden_size, num_hidden_layers, ..., model_type) are this project's keys too (a
shape without model_path builds a randomly initialised model: galaxy.models.random_init).
Pure data, no torch: galaxy.config imports it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# Galaxy-LM key -> (this project's key, why, for the note line).
RENAMED = {
    "lora_att_dim": ("lora_dim", "lora_att_dim -> lora_dim"),
    "num_iterations": ("max_steps", "num_iterations -> max_steps"),
    "init_method": ("init_method", "init_method -> the --init_method default (the command line wins)"),
}
# Keys Galaxy-LM needed for its own loralib / side network that nothing here reads: LoRA here
# knows each projection's layout (fan_in_fan_out), never merges in eval mode (merge_weights:
# export with merge_lora instead) and its side network has no bias sampling switch.
IGNORED = ("fan_in_fan_out", "merge_weights", "add_bias_sampling")
# Its BART and T5 files hold Hugging Face's config keys of the model it built. Their sizes are
# shape keys here too (d_model, encoder_layers, num_layers, d_ff, ...: galaxy.config.SHAPE_KEYS);
# the decoder's sizes must be the encoder's (one split serves both stacks), and BART's
# num_hidden_layers is BartConfig's alias of encoder_layers.
STACK_SHAPE = {"dropout_rate": "dropout"}
SAME_AS_ENCODER = {"decoder_ffn_dim": "encoder_ffn_dim", "decoder_attention_heads": "encoder_attention_heads"}
# What else those files hold: architecture details that a model_path's config.json gives here,
# Hugging Face's output switches, and its THUCNews vocabulary and class files (the tokenizer is
# model_path's; class names come from the data or class_list).
STACK_IGNORED = ("relative_attention_num_buckets", "relative_attention_max_distance", "layer_norm_epsilon",
                 "initializer_factor", "feed_forward_proj", "decoder_start_token_id", "is_encoder_decoder",
                 "pad_token_id", "eos_token_id", "classifier_dropout", "return_dict", "use_cache",
                 "output_attentions", "output_hidden_states", "vocab_path", "class_list_path")
# Every key Galaxy-LM's files use, for "did you mean" suggestions.
KEYS = ("train", "device", "batch_size", "pad_size", "num_epochs", "num_iterations", "hidden_size",
        "intermediate_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "type_vocab_size",
        "model_type", "full_model", "use_lora", "use_adapter", "use_side", "use_side_only", "lora_dim",
        "lora_att_dim", "lora_alpha", "lora_dropout", "fan_in_fan_out", "merge_weights",
        "lora_target_modules", "side_reduction_factor", "add_bias_sampling", "init_method",
        "distributed_backend", "con_parallel_method", "seq_scatter_list", "att_parallel_method",
        "tp_num_attention_heads_list", "mlp_parallel_method", "tp_intermediate_size_list",
        "stage_num_hidden_layers_list", "num_microbatches", *STACK_SHAPE, *SAME_AS_ENCODER, *STACK_IGNORED)


@dataclass
class Translation:
    values: dict                                   # this project's keys -> raw JSON values
    mapped: list[str] = field(default_factory=list)    # "old -> new" phrases for the note line
    ignored: list[str] = field(default_factory=list)   # keys dropped, for the warning line
    problems: list[str] = field(default_factory=list)  # one line each


def translate(raw: dict) -> Translation:
    """raw (a config file's object, comments included) -> this project's keys; see the module doc."""
    out = Translation({})
    stack_keys = _stacks(raw, out)
    for key, value in raw.items():
        if key in stack_keys:
            continue
        if key in IGNORED or key in STACK_IGNORED:
            out.ignored.append(key)
        elif key == "train":
            _train(value, out)
        elif key == "device":
            _device(value, raw, out)
        elif key in RENAMED:
            new, phrase = RENAMED[key]
            if new != key and new in raw:
                if raw[new] != value:
                    out.problems.append(f"{key} {_json(value)} (Galaxy-LM's name for {new}) and {new} "
                                        f"{_json(raw[new])} are both set; keep one")
                continue
            out.values[new] = value
            out.mapped.append(phrase)
        else:
            out.values[key] = value
    return out


def _stacks(raw: dict, out: Translation) -> set[str]:
    """An encoder-decoder's Hugging Face keys that are not this project's: mapped, checked or
    consumed; returns the keys it consumed."""
    used = set()
    for key, ours in ((k, v) for k, v in STACK_SHAPE.items() if k in raw):
        used.add(key)
        if raw.get(ours, raw[key]) != raw[key]:
            out.problems.append(f"{key} {_json(raw[key])} (Hugging Face's name for {ours}) and {ours} "
                                f"{_json(raw[ours])} are both set; keep one")
            continue
        out.values[ours] = raw[key]
        out.mapped.append(f"{key} -> {ours}")
    for decoder, encoder in SAME_AS_ENCODER.items():
        if decoder in raw:
            used.add(decoder)
            if raw[decoder] != raw.get(encoder, raw[decoder]):
                out.problems.append(f"{decoder} {_json(raw[decoder])} differs from {encoder} {_json(raw[encoder])}; "
                                    f"galaxy splits one size over both stacks: make them equal")
    if "encoder_layers" in raw and "num_hidden_layers" in raw:        # BartConfig's alias of encoder_layers
        used.add("num_hidden_layers")
        if raw["num_hidden_layers"] != raw["encoder_layers"]:
            out.problems.append(f"num_hidden_layers {_json(raw['num_hidden_layers'])} and encoder_layers "
                                f"{_json(raw['encoder_layers'])} differ; remove num_hidden_layers")
        else:
            out.mapped.append("num_hidden_layers: BART's alias of encoder_layers (stages count the encoder's "
                              "layers, then the decoder's)")
    return used


def _train(value, out: Translation) -> None:
    """Galaxy-LM's train flag chose training over inference; here it is a key of the same name."""
    if not isinstance(value, bool):
        out.problems.append(f"train must be true or false, got {_json(value)}")
        return
    out.values["train"] = value
    out.mapped.append("train true (training)" if value else
                      "train false -> predictions of the test set only (docs/inference.md)")


def _device(value, raw: dict, out: Translation) -> None:
    """Galaxy-LM's device: here the backend decides (nccl: CUDA, gloo: CPU)."""
    if value == "cpu":
        if "distributed_backend" not in raw:
            out.values["distributed_backend"] = "gloo"
        out.mapped.append("device cpu -> distributed_backend gloo (the CPU)")
    elif isinstance(value, str) and value.startswith("cuda"):
        if raw.get("distributed_backend") == "gloo":   # gloo runs on the CPU here
            out.mapped.append(f"device {value} with distributed_backend gloo -> the CPU (nccl runs on CUDA)")
        else:
            out.mapped.append(f"device {value} -> CUDA when available (the default)")
    else:
        out.problems.append(f"device must be \"cpu\" or \"cuda\", got {_json(value)}")


def _json(value) -> str:
    import json
    return json.dumps(value)
