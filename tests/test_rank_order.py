"""mesh_rank_order beyond the mesh (tests/test_mesh.py) and pipeline parity (tests/test_pipeline.py,
tests/test_generate_plans.py): per-device figures come back by launch rank, and ranks started with
different orders disagree before any process group starts. The pools with an order join the group
through galaxy.launch.init_distributed, as an entry script does (support.dist_pool).
"""
import argparse

from galaxy.config import GalaxyConfig
from galaxy.distributed.agreement import compare, fingerprint


def test_per_device_figures_are_listed_by_launch_rank(dist_pool):
    """The summary's peak memory and generate.py's KV cache list the process started as rank R at
    index R (galaxy.distributed.per_device), where a plain all-gather lists mesh positions."""
    got = dist_pool(4, (2, 0, 3, 1)).run(_gathered)
    assert got == [(["device 0", "device 1", "device 2", "device 3"],
                    ["device 2", "device 0", "device 3", "device 1"])] * 4


def _gathered():
    import torch.distributed as dist

    from support.dist_pool import launch_rank

    from galaxy.distributed.per_device import gather_by_launch_rank
    mine = f"device {launch_rank()}"
    by_position = [None] * dist.get_world_size()
    dist.all_gather_object(by_position, mine)
    return gather_by_launch_rank(mine, launch_rank()), by_position


def test_ranks_started_with_different_orders_disagree():
    """The agreement check (before any process group) names the key."""
    def settings(rank, order):
        cfg = GalaxyConfig(model_path="no-model", mesh_rank_order=order)
        return fingerprint(cfg, None, argparse.Namespace(world=2, rank=rank), "pretrain_galaxy.py")
    assert compare(settings(0, [0, 1]), settings(1, [1, 0]), 1) == (
        "rank 1's settings differ from rank 0's at mesh_rank_order: [0, 1] on rank 0, [1, 0] on rank 1; start "
        "every rank with the same config and arguments")
