"""Scale micro-batch losses so that they add up to the global-batch mean, exactly.

A model's head returns its loss averaged over `model.loss_units(labels)` terms: examples for
classification, label tokens for a causal LM. With D data-parallel replicas, replica d running
micro-batches j with u_dj terms and mean loss l_dj, the global-batch mean is

    L = sum_dj u_dj * l_dj / U,    U = sum_dj u_dj   (all replicas, all micro-batches).

Data parallelism averages gradients over the D replicas, so replica d back-propagates

    L_d = D * sum_j u_dj * l_dj / U,    whose mean over d is L:

micro-batch j's loss is scaled by D * u_dj / U. For classification with equal shards that is
1 / (micro-batches per replica); for a causal LM it weights by token count, where the mean of
micro-batch means would be wrong whenever their token counts differ.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def total_loss_units(model, labels: torch.Tensor, dp_pg) -> torch.Tensor:
    """U: the loss terms of the global batch (this replica's labels summed over replicas)."""
    units = model.loss_units(labels).to(torch.long).reshape(())
    if dp_pg is not None:
        units = units.clone()
        dist.all_reduce(units, group=dp_pg)
    return units


def loss_scale(model, labels: torch.Tensor, total_units: torch.Tensor, dp_size: int) -> torch.Tensor:
    """D * u / U for one micro-batch's labels (a 0-d fp32 tensor; 1 for one replica and one micro-batch)."""
    units = model.loss_units(labels).to(torch.float64)
    return (units * dp_size / total_units.clamp_min(1).to(torch.float64)).to(torch.float32)


def mean_over_replicas(local: torch.Tensor, dp_pg, dp_size: int) -> torch.Tensor:
    """The global-batch mean from each replica's L_d: their average."""
    if dp_pg is None:
        return local
    local = local.detach().clone()
    dist.all_reduce(local, group=dp_pg)
    return local / dp_size
