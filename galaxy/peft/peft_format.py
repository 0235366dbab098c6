"""peft's on-disk format for LoRA: an adapter directory Hugging Face peft reads and writes.

    adapter_config.json         peft_type LORA, task_type, r, lora_alpha, lora_dropout,
                                target_modules, modules_to_save, base_model_name_or_path, ...
    adapter_model.safetensors   full tensors named "base_model.model.<HF module>.lora_A.weight" /
                                ".lora_B.weight", and the modules_to_save weights under
                                "base_model.model.<HF name>" (e.g. the classifier of SEQ_CLS)

so PeftModel.from_pretrained(<HF model>, dir) loads what galaxy trained, and a directory peft
wrote starts galaxy's training (lora_path). Only plain LoRA is read: options that change what
LoRA computes (DoRA, LoRA biases, per-module ranks, layer subsets, ...) are refused by name.

fan_in_fan_out says whether the base projections are stored [in, out] (Hugging Face's Conv1D,
GPT-2); A [r, in] and B [out, r] are the same either way. It is the family's
(FamilySpec.lora_fan_in_fan_out): written so, and read when it is that or False (peft itself
treats a Conv1D target as fan_in_fan_out whatever the file says).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from safetensors.torch import load_file

from galaxy.files import write_safetensors_atomic, write_text_atomic

PREFIX = "base_model.model."
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"

# adapter_config.json keys whose non-default values galaxy's LoRA does not compute.
_UNSUPPORTED = {"use_dora": False, "bias": "none", "rank_pattern": {},
                "alpha_pattern": {}, "layers_to_transform": None, "exclude_modules": None,
                "target_parameters": None, "layer_replication": None, "lora_bias": False}


@dataclass(frozen=True)
class LoraSpec:
    r: int
    alpha: float
    target_modules: tuple[str, ...] | str
    dropout: float = 0.0
    rslora: bool = False


def peft_key(hf_name: str) -> str:
    return PREFIX + hf_name


def read_lora_dir(path: str, fan_in_fan_out: bool = False) -> tuple[LoraSpec, dict[str, torch.Tensor]]:
    """(the directory's LoRA shape, its tensors by peft key). fan_in_fan_out: the model family's
    (FamilySpec.lora_fan_in_fan_out); a directory may say so or False."""
    config_path, weights_path = os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(config_path) or not os.path.isfile(weights_path):
        raise FileNotFoundError(f"lora_path {path!r} is not a peft adapter directory (it needs "
                                f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    with open(config_path) as f:
        cfg = json.load(f)
    if cfg.get("peft_type") != "LORA":
        raise ValueError(f"lora_path {path!r} holds a {cfg.get('peft_type')!r} adapter; only LORA is read")
    for key, default in _UNSUPPORTED.items():
        value = cfg.get(key)
        if value is not None and value != default:
            raise ValueError(f"lora_path {path!r}: {key} = {cfg[key]!r} is not supported by galaxy's "
                             f"LoRA (it computes plain LoRA, {key} = {default!r})")
    if cfg.get("fan_in_fan_out") and not fan_in_fan_out:
        raise ValueError(f"lora_path {path!r}: fan_in_fan_out = true is for projections stored [in, out] "
                         f"(Conv1D); this model's are [out, in]: was it written for another model?")
    targets = cfg["target_modules"]
    spec = LoraSpec(r=int(cfg["r"]), alpha=float(cfg["lora_alpha"]),
                    target_modules=targets if isinstance(targets, str) else tuple(sorted(targets)),
                    dropout=float(cfg.get("lora_dropout", 0.0)), rslora=bool(cfg.get("use_rslora", False)))
    return spec, load_file(weights_path)


def lora_config_json(spec: LoraSpec, model, base_model_path: str, fan_in_fan_out: bool = False) -> dict:
    """adapter_config.json for LoRA `spec` on `model` (its task type and the head it saves);
    fan_in_fan_out: the family's (FamilySpec.lora_fan_in_fan_out)."""
    targets = spec.target_modules
    return {
        "peft_type": "LORA",
        "task_type": model.peft_task_type,
        "base_model_name_or_path": base_model_path,
        "r": spec.r,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": targets if isinstance(targets, str) else sorted(targets),
        "modules_to_save": list(model.modules_to_save) or None,
        "use_rslora": spec.rslora,
        "bias": "none",
        "fan_in_fan_out": fan_in_fan_out,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
    }


def write_lora_dir(path: str, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Write the two files (each atomically: a temporary name, then a rename)."""
    os.makedirs(path, exist_ok=True)
    write_safetensors_atomic(os.path.join(path, WEIGHTS_FILE), tensors)
    write_text_atomic(os.path.join(path, CONFIG_FILE), json.dumps(config, indent=2) + "\n")
