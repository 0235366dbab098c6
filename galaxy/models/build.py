"""A family's model from a Hugging Face directory: its class (the registry's spec), its config, and
its weights read into an already sharded and pruned model (galaxy.runtime.assemble builds one
rank's part: meta build, plan, stage, then these reads)."""
from __future__ import annotations

import torch
from torch import nn
from transformers import AutoConfig

from galaxy.layers.sharding import shard_offset
from galaxy.models.family import FamilySpec
from galaxy.models.registry import family_of
from galaxy.models.weights import LazyCheckpoint


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


def model_class(family: FamilySpec, task: str | None):
    """The family's model class for `task` (None: its first task in FamilySpec.tasks, its primary one)."""
    return family.model_class(next(iter(family.tasks)) if task is None else task)


def locate_weights(model: nn.Module, checkpoint: LazyCheckpoint, family: FamilySpec, rank: int = 0) -> list:
    """Where each parameter of `model` (sharded already; pruned or not) comes from, checked
    against the checkpoint's names and shapes: [(param, checkpoint name or None for a new task
    head, dim, start, full shape)], dim None for a whole tensor, else this rank's slice starts at
    `start` along `dim` (ParamRule "sharded": offset sum(sizes[:rank]), as keep_slice cut it).

    A weight a pipeline end holds as its own copy of a tied weight (model.attached.tied_across_stages:
    {copy: original}) comes from the original's tensor. Shapes are checked at full (unsharded)
    size, so the errors read the same under every plan.
    """
    to_hf = family.hf_names(model.config)
    rules, tied = model.attached.rules, model.attached.tied_across_stages
    prefix = family.hf_base_prefix
    located = []
    for name, param in model.named_parameters():
        hf = to_hf(tied.get(name, name))
        source = hf
        if source not in checkpoint and prefix and hf.startswith(prefix):
            source = hf[len(prefix):]     # a bare base-model checkpoint
        dim, start, full_shape = _shard_of(name, param, rules.get(name), rank)
        if source not in checkpoint:
            if name not in family.hf_head_params:
                raise CheckpointError(f"checkpoint has no tensor {hf!r} (for {name})")
            source = None
        elif checkpoint.shape(source) != full_shape:
            raise CheckpointError(f"checkpoint tensor {hf!r} has shape {checkpoint.shape(source)}, "
                                  f"the model needs {full_shape} (check num_labels / class_list)")
        located.append((param, source, dim, start, full_shape))
    return located


@torch.no_grad()
def load_hf_weights(model: nn.Module, checkpoint: LazyCheckpoint, family: FamilySpec, seed: int,
                    rank: int = 0) -> None:
    """Copy every parameter of `model` (sharded and pruned already, materialised) from the
    checkpoint, reading only this rank's slice of a sharded one (locate_weights)."""
    missing_head = []
    for param, source, dim, start, full_shape in locate_weights(model, checkpoint, family, rank):
        if source is None:
            missing_head.append((param, dim, start, full_shape))
        else:
            checkpoint.read_into(source, param, dim, start)
    if missing_head:
        # A new task head, initialised as Hugging Face does, from the shared seed so that every
        # rank draws the same values (drawn at full shape, then sliced, should a plan shard it).
        gen = torch.Generator().manual_seed(seed)
        std = getattr(model.config, "initializer_range", 0.02)
        for param, dim, start, full_shape in missing_head:
            if param.dim() > 1:
                full = torch.empty(full_shape, dtype=param.dtype).normal_(0.0, std, generator=gen)
                param.copy_(full if dim is None else full.narrow(dim, start, param.shape[dim]))
            else:
                param.zero_()


def _shard_of(name: str, param: torch.Tensor, rule, rank: int):
    """(dim, start, full shape) of this rank's slice; dim None when the parameter is whole."""
    if rule is None or rule.kind != "sharded":
        return None, 0, tuple(param.shape)
    if param.shape[rule.dim] != rule.sizes[rank]:
        raise RuntimeError(f"{name} has {param.shape[rule.dim]} entries along dim {rule.dim}, "
                           f"its rule gives rank {rank} {rule.sizes[rank]}")
    full_shape = list(param.shape)
    full_shape[rule.dim] = sum(rule.sizes)
    return rule.dim, shard_offset(rule.sizes, rank), tuple(full_shape)
