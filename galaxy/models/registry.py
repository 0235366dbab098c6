"""Model families: how to build each from a Hugging Face config and map its weight names.

Adding a family means writing its sub-blocks (ATT, CON, MLP), its head, and a name map.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

from galaxy.models import bert, llama
from galaxy.models.weights import NameMap


@dataclass(frozen=True)
class Family:
    name: str
    build: Callable[..., nn.Module]            # (hf_config, **task args) -> model
    hf_name_fn: Callable[[object], Callable]   # hf_config -> (galaxy name -> HF name)
    hf_base_prefix: str                        # prefix a bare base-model checkpoint lacks
    hf_head_params: tuple[str, ...]            # galaxy names that may be absent (new task head)


FAMILIES = {
    "bert": Family("bert", bert.BertForClassification, lambda cfg: NameMap(bert.HF_NAMES),
                   bert.HF_BASE_PREFIX, bert.HF_HEAD_PARAMS),
    "llama": Family("llama", llama.LlamaForCausalLM, llama.hf_name_fn, "", ()),
}


def family_of(model_type: str) -> Family:
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise ValueError(f"model_type {model_type!r} is not supported; known: {sorted(FAMILIES)}") from None
