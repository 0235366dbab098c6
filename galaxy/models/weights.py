"""Reading Hugging Face checkpoints and mapping parameter names both ways.

Only safe formats are read: safetensors, or pytorch_model.bin through
torch.load(weights_only=True). Sharded checkpoints (an *.index.json) are followed.
"""
from __future__ import annotations

import json
import os
import re

import torch
from safetensors.torch import load_file


def read_hf_state_dict(model_path: str) -> dict[str, torch.Tensor]:
    for index_name, reader in (("model.safetensors.index.json", load_file),
                               ("pytorch_model.bin.index.json", _load_bin)):
        index = os.path.join(model_path, index_name)
        if os.path.exists(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
            state = {}
            for name in files:
                state.update(reader(os.path.join(model_path, name)))
            return state
    single = os.path.join(model_path, "model.safetensors")
    if os.path.exists(single):
        return load_file(single)
    legacy = os.path.join(model_path, "pytorch_model.bin")
    if os.path.exists(legacy):
        return _load_bin(legacy)
    raise FileNotFoundError(f"model_path {model_path!r} has no model.safetensors or pytorch_model.bin")


def _load_bin(path: str) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)


class NameMap:
    """Translate names with a table of patterns: {i} matches a layer index, other fields any text."""

    def __init__(self, table: dict[str, str]):
        self.rules = [(self._regex(ours), theirs) for ours, theirs in table.items()]

    @staticmethod
    def _regex(pattern: str) -> re.Pattern:
        out = re.escape(pattern)
        out = out.replace(re.escape("{i}"), r"(?P<i>\d+)")
        out = re.sub(r"\\\{(\w+)\\\}", lambda m: f"(?P<{m.group(1)}>.+)", out)
        return re.compile(f"^{out}$")

    def __call__(self, name: str) -> str:
        for regex, target in self.rules:
            m = regex.match(name)
            if m:
                return target.format(**m.groupdict())
        raise KeyError(f"no Hugging Face name for parameter {name!r}")
