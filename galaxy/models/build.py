"""A family's model from a Hugging Face directory: its class (the registry's spec), its config, and
its weights read into an already sharded and pruned model (galaxy.runtime.assemble builds one
rank's part: meta build, plan, stage, then these reads)."""
from __future__ import annotations

import torch
from torch import nn

from galaxy.models.family import FamilySpec
from galaxy.models.weights import LazyCheckpoint


class CheckpointError(ValueError):
    pass


def load_hf_config(model_path: str, dropout: float | None = None):
    # Imported here: a job that stops at the config checks never pays transformers' import.
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(model_path)
    if dropout is not None:
        # Every family's dropout probabilities (BERT, Llama, GPT-2's embd/attn/resid_pdrop, BART's
        # dropout and activation_dropout, T5's dropout_rate).
        for key in ("hidden_dropout_prob", "attention_probs_dropout_prob", "attention_dropout",
                    "embd_pdrop", "attn_pdrop", "resid_pdrop", "dropout", "activation_dropout", "dropout_rate"):
            if hasattr(cfg, key):
                setattr(cfg, key, dropout)
        if getattr(cfg, "classifier_dropout", None) is not None:
            cfg.classifier_dropout = dropout
    return cfg


@torch.no_grad()
def tie_as_checkpoint(cfg, checkpoint: LazyCheckpoint, family: FamilySpec):
    """cfg, untied (tie_word_embeddings False) when the checkpoint holds the family's tied pair
    (FamilySpec.hf_tied) with different values: Hugging Face then loads both, apart."""
    if not family.hf_tied or not getattr(cfg, "tie_word_embeddings", False):
        return cfg
    if not all(name in checkpoint for name in family.hf_tied):
        return cfg
    head, table = (torch.empty(checkpoint.shape(name)) for name in family.hf_tied)
    checkpoint.read_into(family.hf_tied[0], head)
    checkpoint.read_into(family.hf_tied[1], table)
    if not torch.equal(head, table):
        cfg.tie_word_embeddings = False
    return cfg


def model_class(family: FamilySpec, task: str | None):
    """The family's model class for `task` (None: its first task in FamilySpec.tasks, its primary one)."""
    return family.model_class(next(iter(family.tasks)) if task is None else task)


def locate_weights(model: nn.Module, checkpoint: LazyCheckpoint, family: FamilySpec, rank: int = 0) -> list:
    """Where each parameter of `model` (sharded already; pruned or not) comes from, checked
    against the checkpoint's names and shapes: [(param, checkpoint name or None for a new task
    head, rule, full shape)], rule the parameter's ParamRule when it is sharded (this rank holds
    rule.spans(rank) of the whole, as keep_slice cut it), else None; full shape in galaxy's
    layout ([out, in]).

    A weight a pipeline end holds as its own copy of a tied weight (model.attached.tied_across_stages:
    {copy: original}) comes from the original's tensor. Shapes are checked at full (unsharded)
    size and in the checkpoint's layout (family.hf_layout: transposed Conv1D weights), so the
    errors read the same under every plan.
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
        rule, full_shape = _shard_of(name, param, rules.get(name), rank)
        stored = full_shape[::-1] if family.hf_layout(hf) else full_shape
        if source not in checkpoint:
            if name not in family.hf_head_params:
                raise CheckpointError(f"checkpoint has no tensor {hf!r} (for {name})")
            source = None
        elif checkpoint.shape(source) != stored:
            raise CheckpointError(f"checkpoint tensor {hf!r} has shape {checkpoint.shape(source)}, "
                                  f"the model needs {stored} (check num_labels / class_list)")
        located.append((param, source, rule, full_shape))
    return located


@torch.no_grad()
def load_hf_weights(model: nn.Module, checkpoint: LazyCheckpoint, family: FamilySpec, seed: int,
                    rank: int = 0) -> None:
    """Copy every parameter of `model` (sharded and pruned already, materialised) from the
    checkpoint, reading only this rank's slice of a sharded one (locate_weights)."""
    missing_head = []
    for param, source, rule, full_shape in locate_weights(model, checkpoint, family, rank):
        if source is None:
            missing_head.append((param, rule, full_shape))
        else:
            read_param(checkpoint, source, param, rule, rank, family.hf_layout(source))
    if missing_head:
        # A new task head, initialised as Hugging Face does, from the shared seed so that every
        # rank draws the same values (drawn at full shape, then sliced, should a plan shard it).
        gen = torch.Generator().manual_seed(seed)
        std = getattr(model.config, "initializer_range", 0.02)
        for param, rule, full_shape in missing_head:
            if param.dim() > 1:
                full = torch.empty(full_shape, dtype=param.dtype).normal_(0.0, std, generator=gen)
                param.copy_(full if rule is None else rule.local(full, rank))
            else:
                param.zero_()


def read_param(checkpoint: LazyCheckpoint, source: str, param: torch.Tensor, rule: ParamRule | None,
               rank: int, transposed: bool) -> None:
    """Read this rank's share of checkpoint tensor `source` into `param`: one read per piece of
    the share (one; `parts` for a fused projection's blocks). transposed: the checkpoint holds
    the tensor [in, out], so each piece is read through a transposed view of its destination,
    along the other dimension."""
    if rule is None:
        pieces = [(param, None, 0)]
    else:
        n = rule.sizes[rank]
        pieces = [(param.narrow(rule.dim, k * n, n), rule.dim, start)
                  for k, (start, _) in enumerate(rule.spans(rank))]
    for out, dim, start in pieces:
        if transposed:
            out, dim = out.t(), None if dim is None else 1 - dim
        checkpoint.read_into(source, out, dim, start)


def _shard_of(name: str, param: torch.Tensor, rule: ParamRule | None, rank: int):
    """(the rule when the parameter is sharded, else None; its full shape)."""
    if rule is None or rule.kind != "sharded":
        return None, tuple(param.shape)
    if param.shape[rule.dim] != rule.parts * rule.sizes[rank]:
        raise RuntimeError(f"{name} has {param.shape[rule.dim]} entries along dim {rule.dim}, "
                           f"its rule gives rank {rank} {rule.parts} x {rule.sizes[rank]}")
    return rule, rule.full_shape(param.shape)
