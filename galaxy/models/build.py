"""Build a model from a Hugging Face directory, load its weights, apply a parallel plan."""
from __future__ import annotations

import torch
from torch import nn
from transformers import AutoConfig

from galaxy.distributed.group import GalaxyGroup
from galaxy.layers.rng import ShardedRNG
from galaxy.models.registry import Family, family_of
from galaxy.models.weights import read_hf_state_dict
from galaxy.parallel.plan import ParallelPlan, apply_plan


class CheckpointError(ValueError):
    pass


def load_hf_config(model_path: str, dropout: float | None = None):
    cfg = AutoConfig.from_pretrained(model_path)
    if dropout is not None:
        for key in ("hidden_dropout_prob", "attention_probs_dropout_prob", "attention_dropout"):
            if hasattr(cfg, key):
                setattr(cfg, key, dropout)
        if getattr(cfg, "classifier_dropout", None) is not None:
            cfg.classifier_dropout = dropout
    return cfg


def build_model(model_path: str, plan: ParallelPlan, group: GalaxyGroup, *, num_labels: int | None = None,
                seed: int = 0, device: torch.device | str = "cpu", dropout: float | None = None) -> nn.Module:
    """Every rank builds the full model on the meta device, loads the checkpoint, keeps its shard.

    num_labels: classifier outputs (classification families); ignored by causal LMs.
    """
    cfg = load_hf_config(model_path, dropout)
    family = family_of(cfg.model_type)
    with torch.device("meta"):
        model = family.build(cfg, num_labels=num_labels)
    model.to_empty(device="cpu")
    if hasattr(model, "materialize"):     # non-checkpoint state: rotary tables, tied weights
        model.materialize()
    load_hf_weights(model, read_hf_state_dict(model_path), family, seed)
    device = torch.device(device)
    apply_plan(model, plan, group, ShardedRNG(seed, group.rank, device))
    return model.to(device)


@torch.no_grad()
def load_hf_weights(model: nn.Module, state: dict[str, torch.Tensor], family: Family, seed: int) -> None:
    to_hf = family.hf_name_fn(model.config)
    missing_head = []
    for name, param in model.named_parameters():
        hf = to_hf(name)
        tensor = state.get(hf)
        if tensor is None and family.hf_base_prefix and hf.startswith(family.hf_base_prefix):
            tensor = state.get(hf[len(family.hf_base_prefix):])
        if tensor is None:
            if name in family.hf_head_params:
                missing_head.append(param)
                continue
            raise CheckpointError(f"checkpoint has no tensor {hf!r} (for {name})")
        if tuple(tensor.shape) != tuple(param.shape):
            raise CheckpointError(f"checkpoint tensor {hf!r} has shape {tuple(tensor.shape)}, "
                                  f"the model needs {tuple(param.shape)} (check num_labels / class_list)")
        param.copy_(tensor)
    if missing_head:
        # A new task head, initialised as Hugging Face does, from the shared seed so that every
        # rank draws the same values.
        gen = torch.Generator().manual_seed(seed)
        std = getattr(model.config, "initializer_range", 0.02)
        for param in missing_head:
            if param.dim() > 1:
                param.normal_(0.0, std, generator=gen)
            else:
                param.zero_()
