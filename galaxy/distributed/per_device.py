"""Figures a user reads per device (peak memory, KV cache), listed by launch rank.

Under mesh_rank_order the default group's rank is the mesh position, not the rank the process
was started as (galaxy.launch.DistEnv); a list in group order would put the phone's figure where
the user reads "rank 0". These gathers return the list in launch-rank order instead.
"""
from __future__ import annotations

import torch.distributed as dist


def gather_by_launch_rank(value, launch_rank: int) -> list:
    """Collective over the default group: every process's value, the one started as --rank R at
    index R, whatever mesh position it holds."""
    if dist.get_world_size() == 1:
        return [value]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (launch_rank, value))
    return [v for _, v in sorted(every, key=lambda pair: pair[0])]
