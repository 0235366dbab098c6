"""Optimizer state in full (unsharded) shape, keyed by parameter name: plan- and world-free.

A sharded parameter's per-element state (AdamW's exp_avg / exp_avg_sq, SGD's momentum_buffer) is
sharded exactly like the parameter, so it is gathered with the parameter's rule (ParamRule.dim,
.sizes, .parts: galaxy.parallel.full_state.gather_param) and, on load, sliced back with the rule
of the loading rank (ParamRule.local), which may belong to another plan or world size. Scalar state (AdamW's step) and state of unsharded parameters is the same on
every rank of the group and is saved as is.

Saved form: tensors {"<param name>/<state key>": full tensor} and the parameter groups'
hyperparameters (everything but "params") as JSON-able dicts.

Pipeline parallelism: every stage has its own optimizer over its own parameters (same groups,
same hyperparameters). Saving gathers each stage's tensors to the writer (global rank 0) with the
stage pieces of galaxy.pipeline.stage_state, so the file is the one a pp_deg 1 run writes; the
groups are the writer's (stage 0's). Loading, each stage takes the state of the parameters it
owns (stage_state.stage_owns) and leaves the others' to them, whatever layout wrote the file.
A weight tied across the pipeline's ends is saved once, under the first stage's name; the last
stage's copy loads that state too (the copies take identical steps, so their states are equal).

Sharded data parallelism (dp_sharding): per-element state is a DTensor sharded over the replicas
like its parameter. Saving gathers it over the dp group first (every replica takes part), then
over the Galaxy group as above; loading slices the Galaxy share and then this replica's dp slice
(galaxy.parallel.sharded_dp.like), so the file is the same whatever sharding wrote or reads it.
"""
from __future__ import annotations

import torch

from galaxy.models.attached import written_names
from galaxy.parallel.full_state import gather_param
from galaxy.parallel.sharded_dp import full as dp_full, like
from galaxy.pipeline.stage_state import in_writer_replica, stage_owns, stages_to_writer, tied_sources
from galaxy.train.optim import STEP_FLAGS


def _named_groups(model, optimizer):
    """[(group, [(name, param)])] in the optimizer's order."""
    names = {p: n for n, p in model.named_parameters()}
    return [(g, [(names[p], p) for p in g["params"]]) for g in optimizer.param_groups]


@torch.no_grad()
def gather_optimizer_state(model, optimizer, mesh=None) -> tuple[dict[str, torch.Tensor] | None, list[dict]]:
    """Collective: every rank must call it. Tensors come back on the CPU.

    mesh None: over the Galaxy group, every rank gets its model's (or stage's) state. mesh given:
    over every rank, the writer (global rank 0) gets every pipeline stage's tensors; ranks that
    do not write may get None for the tensors.
    """
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items() if k != "params"}
              for group in optimizer.param_groups]
    if not in_writer_replica(mesh, model):
        return None, groups
    pg = model.attached.group.pg
    tensors, written = {}, written_names(model)
    for _, named in _named_groups(model, optimizer):
        for name, p in named:
            if name not in written:
                continue                # a tied weight's copy: its state is the original's
            rule = model.attached.rules[name]
            for key, value in optimizer.state.get(p, {}).items():
                if not torch.is_tensor(value):
                    continue            # e.g. SGD's momentum_buffer=None before momentum is used
                value = dp_full(value)  # dp-sharded state: gathered over the replicas (collective)
                if rule.kind == "sharded" and value.shape == p.shape:
                    value = gather_param(value, rule, pg)
                tensors[f"{name}/{key}"] = value.detach().to("cpu", copy=True).contiguous()
    return stages_to_writer(mesh, tensors), groups


@torch.no_grad()
def load_optimizer_state(model, optimizer, tensors: dict[str, torch.Tensor], groups: list[dict]) -> set[str]:
    """Slice full-shape state for this rank (under the current plan) and load it (no collective).

    On a pipeline stage, state of parameters other stages own is left alone; returns those
    parameter names (galaxy.pipeline.stage_state.agree_on_load checks that some stage took each).
    Raises ValueError for state of a parameter this rank's part should hold but does not.
    """
    rank, copies = model.attached.group.rank, tied_sources(model)
    by_param: dict[str, dict[str, torch.Tensor]] = {}
    others: set[str] = set()
    for key, full in tensors.items():
        name, state_key = key.rsplit("/", 1)
        if not stage_owns(model, name):
            others.add(name)
            continue
        by_param.setdefault(copies.get(name, name), {})[state_key] = full
    named_groups = _named_groups(model, optimizer)
    if len(groups) != len(named_groups):
        raise ValueError(f"checkpoint has {len(groups)} optimizer parameter groups, "
                         f"the optimizer has {len(named_groups)}")
    state, param_groups = {}, []
    for saved, (current, named) in zip(groups, named_groups):
        # JSON turned tuples (AdamW's betas) into lists; give them back their type.
        saved = {k: tuple(v) if isinstance(current.get(k), tuple) else v for k, v in saved.items()}
        ids = []
        for name, p in named:
            rule, entry = model.attached.rules[name], {}
            for state_key, full in by_param.pop(name, {}).items():
                if full.dim() == p.dim():       # per-element state: the parameter's full shape
                    if tuple(full.shape) != rule.full_shape(p.shape):
                        raise ValueError(f"optimizer state {name}/{state_key} has shape "
                                         f"{tuple(full.shape)}, the parameter's is {rule.full_shape(p.shape)}")
                    full = like(rule.local(full, rank), p)     # and this replica's dp slice
                entry[state_key] = full.clone()
            ids.append(len(state))
            state[len(state)] = entry
        # Which step runs (fused, foreach) was chosen for this run's parameters (galaxy.train.optim):
        # a checkpoint from another layout carries its own choice, e.g. fused SGD, which FSDP's
        # DTensors do not support.
        step = {k: current[k] for k in STEP_FLAGS if k in current}
        param_groups.append({**saved, **step, "params": ids})
    if by_param:
        raise ValueError(f"checkpoint has optimizer state for parameters the model lacks: "
                         f"{sorted(by_param)[:3]}")
    # load_state_dict casts per-element state to each parameter's device and dtype.
    optimizer.load_state_dict({"state": state, "param_groups": param_groups})
    return others
