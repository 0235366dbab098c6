"""Many prompts over the data-parallel replicas: replica d generates prompts d, d + dp, d + 2 dp, ...
in batches of its own (or, with uneven shares, rows[d] of every sum(rows) consecutive prompts, in
batches of rows[d]: a replica on a faster device takes more), and every rank ends with every
completion, in input order.

The replicas do not step together: each runs its own batches (their prompts may need different
numbers of steps), and they meet once, at the end, in one all-gather over the dp group.
"""
from __future__ import annotations

import torch.distributed as dist

from galaxy.distributed.per_device import gather_by_launch_rank
from galaxy.inference.requests import Completion, Request


def replica_batch(cfg, plan):
    """The prompts a replica generates together: batch_size / dp_deg, or each replica's
    dp_batch_list entry (a list)."""
    return list(plan.replica_rows) if plan.replica_rows is not None else max(1, cfg.batch_size // plan.dp)


def replica_requests(count: int, dp_rank: int, dp_size: int, rows) -> tuple[list[int], int]:
    """(the indices of replica dp_rank's requests out of count, its rows per batch). rows: the
    prompts every replica generates together (an int), or each replica's (the plan's dp_batch_list)."""
    if isinstance(rows, int):
        return list(range(dp_rank, count, dp_size)), rows
    block, start = sum(rows), sum(rows[:dp_rank])
    return [i for i in range(count) if start <= i % block < start + rows[dp_rank]], rows[dp_rank]


def generate_all(engine, requests: list[Request], rows_per_batch, on_token=None) -> list[Completion]:
    """Every request's completion (collective over the mesh: every rank calls it with the same
    requests). rows_per_batch: the prompts one replica generates together, or every replica's
    (a list, in dp-rank order). on_token(index, token, status): each token of this replica's
    requests as soon as this rank has it."""
    mesh = engine.mesh
    mine, rows_per_batch = replica_requests(len(requests), mesh.dp_rank, mesh.dp_size, rows_per_batch)
    done: dict[int, Completion] = {}
    peak = 0
    for start in range(0, len(mine), rows_per_batch):
        rows = mine[start:start + rows_per_batch]
        hear = None if on_token is None else (lambda row, token, status: on_token(rows[row], token, status))
        done.update(zip(rows, engine.generate([requests[i] for i in rows], hear)))
        peak = max(peak, engine.cache_bytes)
    engine.cache_bytes = peak
    if mesh.dp_pg is not None:
        every = [None] * mesh.dp_size
        dist.all_gather_object(every, done, group=mesh.dp_pg)
        done = {i: c for part in every for i, c in part.items()}
    return [done[i] for i in range(len(requests))]


def cache_mib_per_rank(engine, launch_rank: int) -> list[float]:
    """Every rank's KV cache (MiB, the largest batch's), in launch-rank order (collective)."""
    return gather_by_launch_rank(engine.cache_bytes / 2 ** 20, launch_rank)
