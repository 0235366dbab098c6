"""The sizes in a model folder's config.json that plans, splits and meshes depend on, read before
any model is built (and before any process group starts): one-line errors name the file."""
from __future__ import annotations

import json
import os

from galaxy.config import ConfigError, is_int as _is_int, show as _show
from galaxy.models.registry import FAMILIES, supported_model_types


def read_model_shape(model_path) -> dict:
    """The sizes in a model folder's config.json that the parallel splits depend on."""
    path = os.path.join(os.fspath(model_path), "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model_path config {path!r} cannot be read as JSON: {e}") from None
    _check_model_type(raw.get("model_type"), path)
    raw = with_shape_keys(raw, path)
    shape = {}
    for key in _SHAPE_KEYS:
        if not _is_int(raw.get(key)) or raw[key] < 1:
            raise ConfigError(f"model_path config {path!r} needs a positive integer '{key}', "
                              f"got {_show(raw.get(key))}")
        shape[key] = raw[key]
    heads = shape["num_attention_heads"]
    kv = raw.get("num_key_value_heads") or heads  # absent or null: plain multi-head attention
    if not _is_int(kv) or kv < 1 or heads % kv:
        raise ConfigError(f"model_path config {path!r} has num_key_value_heads {kv}, which must "
                          f"divide num_attention_heads {heads}")
    shape["num_key_value_heads"] = kv
    shape["model_type"] = raw.get("model_type")
    shape["is_encoder_decoder"] = bool(raw.get("is_encoder_decoder"))
    return shape


_SHAPE_KEYS = ("num_attention_heads", "intermediate_size", "hidden_size", "num_hidden_layers",
               "max_position_embeddings")


def with_shape_keys(raw: dict, path: str) -> dict:
    """A config.json dict, plus the shape keys its family names otherwise (FamilySpec.config_shape:
    GPT-2's n_embd, n_head, ...), so that every family's sizes read under the standard names."""
    if all(k in raw for k in _SHAPE_KEYS):
        return raw
    for spec in FAMILIES.values():
        if raw.get("model_type") in spec.model_types and spec.config_shape is not None:
            try:
                return {**raw, **spec.config_shape(raw)}
            except ValueError as e:
                raise ConfigError(f"model_path config {path!r}: {e}") from None
    return raw


def _check_model_type(model_type, path: str) -> None:
    """Name the model type and the supported ones before any size key is looked for: another
    family's config.json spells its sizes differently (GPT-2: n_head), which says nothing useful."""
    if model_type not in supported_model_types():
        raise ConfigError(f"model_path config {path!r} has model_type {_show(model_type)}, which galaxy "
                          f"does not train; supported model types: {', '.join(supported_model_types())}")
