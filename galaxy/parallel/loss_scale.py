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

Scalar collectives per step over the replicas: U needs an all-reduce before the first backward
unless the loss terms are the rows and the replicas' shares are known (classification: U is the
global batch's rows, D x this replica's rows when they are even, the sum of dp_batch_list's
entries when not; no collective); the loss needs one at the end, and counts the
trainer wants summed over replicas too (the step's tokens) ride along in that same all-reduce
(`riding_with_the_loss`) instead of costing their own.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

from galaxy.distributed import waiting


def total_loss_units(model, labels: torch.Tensor, dp_pg, replica_rows=None) -> torch.Tensor:
    """U: the loss terms of the global batch (this replica's labels summed over replicas).
    replica_rows: every replica's rows (the plan's dp_batch_list), None when they are even."""
    units = model.loss_units(labels).to(torch.long).reshape(())
    if dp_pg is not None:
        if getattr(model, "loss_units_are_rows", False):
            # Every row is a term, and galaxy.data gives each replica its known share of the rows.
            if replica_rows is not None:
                return torch.full_like(units, sum(replica_rows))
            return units * dist.get_world_size(dp_pg)
        units = units.clone()
        waiting.all_reduce(units, group=dp_pg)
    return units


class StepTotals:
    """Per-replica counts of one step ([n] tensor) and, once the loss's reduction has run, their
    sums over the replicas (`total`; None until then)."""

    def __init__(self, counts: torch.Tensor):
        self.local = counts.detach().reshape(-1)
        self.total: torch.Tensor | None = None

    def settle(self, total: torch.Tensor) -> None:
        self.total = total.to(self.local.dtype)


_riders: list[StepTotals] = []


@contextmanager
def riding_with_the_loss(counts: torch.Tensor):
    """Within the block, the step's loss reduction (mean_over_replicas) also sums `counts` over
    the replicas, in the same all-reduce; yields the StepTotals it fills."""
    rider = StepTotals(counts)
    _riders.append(rider)
    try:
        yield rider
    finally:
        _riders.remove(rider)


def current_rider() -> StepTotals | None:
    """The innermost StepTotals not yet settled (None: nobody asked)."""
    return _riders[-1] if _riders and _riders[-1].total is None else None


def loss_scale(model, labels: torch.Tensor, total_units: torch.Tensor, dp_size: int) -> torch.Tensor:
    """D * u / U for one micro-batch's labels (a 0-d fp32 tensor; 1 for one replica and one micro-batch)."""
    units = model.loss_units(labels).to(torch.float64)
    return (units * dp_size / total_units.clamp_min(1).to(torch.float64)).to(torch.float32)


def mean_over_replicas(local: torch.Tensor, dp_pg, dp_size: int) -> torch.Tensor:
    """The global-batch mean from each replica's L_d: their average (one all-reduce, which also
    settles the counts riding with the loss, if any)."""
    rider = current_rider()
    if dp_pg is None:
        if rider is not None:
            rider.settle(rider.local.clone())
        return local
    packed = local.detach().reshape(1).to(torch.float64)        # [1 + riders]: exact for counts
    if rider is not None:
        packed = torch.cat([packed, rider.local.to(packed)])
    waiting.all_reduce(packed, group=dp_pg)
    if rider is not None:
        rider.settle(packed[1:])
    return (packed[0] / dp_size).to(local.dtype)
