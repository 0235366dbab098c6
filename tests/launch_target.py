"""A tiny entry script for tests/test_launch.py: galaxy.launch.main with a toy train_fn.

LAUNCH_TARGET_DIE_RANK=<r> makes rank r exit abruptly between its two collectives, to
stand in for a peer that crashes or is killed mid-training.
"""

import os

import torch
import torch.distributed as dist

from galaxy.launch import main


def train(cfg, env):
    t = torch.full((1,), float(env.rank + 1))
    dist.all_reduce(t)
    assert t.item() == env.world * (env.world + 1) / 2, t
    if os.environ.get("LAUNCH_TARGET_DIE_RANK") == str(env.rank):
        os._exit(9)
    dist.all_reduce(t)
    print(f"rank {env.rank}/{env.world} ok backend={env.backend} device={env.device}", flush=True)


if __name__ == "__main__":
    main(preset="galaxy", train_fn=train, script="launch_target.py")
