"""Activations by the names Hugging Face configs use (hidden_act, activation_function, the
adapters' non_linearity): transformers' own modules, looked up on first use.

transformers.activations is imported here, inside the call, and not where a model file is
imported: every process imports the model families (galaxy.launch checks a config against its
family before any process group starts), and a run that stops at those checks should not pay
for transformers' import (seconds on a loaded 2-core machine).
"""
from __future__ import annotations

from torch import nn


def activation(name: str, key: str = "activation") -> nn.Module:
    """transformers' ACT2FN[name]; a ValueError naming `key` (the config key it came from) when
    transformers has no activation of that name."""
    from transformers.activations import ACT2FN
    if name not in ACT2FN:
        raise ValueError(f"{key} {name!r} is unknown; use one of relu, gelu, silu, tanh "
                         "(any name of transformers' ACT2FN)")
    return ACT2FN[name]
