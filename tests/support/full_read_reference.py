"""The build before sharded loading, kept as a reference for tests and bench/load_memory.py.

Every rank materialised the full model, read the whole checkpoint (read_hf_state_dict), copied
every tensor in, then apply_plan sliced the TP projections to the rank's share and keep_stage
dropped what other pipeline stages run. galaxy.models.build must end with bit-identical
parameters while reading only what the rank keeps.
"""
from __future__ import annotations

import torch

from galaxy.layers.rng import ShardedRNG
from galaxy.models.build import CheckpointError, load_hf_config, model_class
from galaxy.models.registry import family_of
from galaxy.models.weights import read_hf_state_dict
from galaxy.parallel.plan import apply_plan
from galaxy.pipeline.stage import keep_stage


def full_read_build(model_path, plan, group, *, num_labels=None, seed=0, dropout=None, stage=None):
    cfg = load_hf_config(model_path, dropout)
    family = family_of(cfg.model_type)
    with torch.device("meta"):
        model = model_class(family, None)(cfg, num_labels=num_labels)
    model.to_empty(device="cpu")
    model.materialize()
    _copy_whole(model, read_hf_state_dict(model_path), family, seed)
    apply_plan(model, plan, group, ShardedRNG(seed, group.rank, torch.device("cpu")))
    if stage is not None:
        keep_stage(model, *stage)
    return model


@torch.no_grad()
def _copy_whole(model, state, family, seed) -> None:
    to_hf = family.hf_names(model.config)
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
        if tuple(family.from_hf(hf, tensor).shape) != tuple(param.shape):
            need = tuple(family.from_hf(hf, param).shape)      # in the checkpoint's layout
            raise CheckpointError(f"checkpoint tensor {hf!r} has shape {tuple(tensor.shape)}, "
                                  f"the model needs {need} (check num_labels / class_list)")
        param.copy_(family.from_hf(hf, tensor))
    gen = torch.Generator().manual_seed(seed)
    std = getattr(model.config, "initializer_range", 0.02)
    for param in missing_head:
        if param.dim() > 1:
            param.normal_(0.0, std, generator=gen)
        else:
            param.zero_()
