"""Model families: how to build each from a Hugging Face config and map its weight names."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

from galaxy.models import bert


@dataclass(frozen=True)
class Family:
    name: str
    build: Callable[..., nn.Module]          # (hf_config, **task args) -> model
    hf_names: dict[str, str]                 # galaxy pattern -> HF pattern
    hf_base_prefix: str                      # prefix a bare base-model checkpoint lacks
    hf_head_params: tuple[str, ...]          # galaxy names that may be absent (new task head)


FAMILIES = {
    "bert": Family("bert", bert.BertForClassification, bert.HF_NAMES, bert.HF_BASE_PREFIX, bert.HF_HEAD_PARAMS),
}


def family_of(model_type: str) -> Family:
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise ValueError(f"model_type {model_type!r} is not supported; known: {sorted(FAMILIES)}") from None
