"""A tiny entry script for tests/test_launch.py: galaxy.launch.main with a toy train_fn.

LAUNCH_TARGET_DIE_RANK=<r> makes rank r exit abruptly between its two collectives, to
stand in for a peer that crashes or is killed mid-training. LAUNCH_TARGET_BAR=1 shows a progress
bar on rank 0 (as the trainer does) while that happens. LAUNCH_TARGET_HOLD=<file> keeps every
rank after the rendezvous until that file exists, to stand in for a job that is running (each
rank prints "rank R joined" once past the rendezvous, so a test acts while the job surely holds
its port). Each rank prints, by its launch rank, its mesh position (mesh_rank_order), and
how it waits for collectives (config key comm_wait, galaxy.distributed.waiting) and whether memory
it frees stays mapped (config key cpu_allocator, galaxy.runtime.cpu_allocator).
"""

import os
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

from galaxy.distributed import waiting
from galaxy.launch import main


def freed_memory_stays() -> bool:
    """Whether 64 MiB this process touches and frees stays resident: glibc returns a block that big
    to the OS on free unless cpu_allocator "keep" turned its mmap path off."""
    def rss_kib() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    block = b"\x01" * (64 << 20)
    held = rss_kib()
    del block
    return held - rss_kib() < (32 << 10)


def train(cfg, env):
    bar = tqdm(total=10, desc="train", disable=env.rank != 0 or not os.environ.get("LAUNCH_TARGET_BAR"))
    bar.update(1)
    t = torch.full((1,), float(env.rank + 1))
    dist.all_reduce(t)
    assert t.item() == env.world * (env.world + 1) / 2, t
    print(f"rank {env.launch_rank} joined", flush=True)
    hold = os.environ.get("LAUNCH_TARGET_HOLD")
    deadline = time.monotonic() + 120         # a test that died without releasing: do not linger
    while hold and not os.path.exists(hold) and time.monotonic() < deadline:
        time.sleep(0.05)
    if os.environ.get("LAUNCH_TARGET_DIE_RANK") == str(env.launch_rank):
        os._exit(9)
    dist.all_reduce(t)
    bar.close()
    waits = "poll" if waiting.polling() else "block"
    print(f"rank {env.launch_rank}/{env.world} ok backend={env.backend} device={env.device} waits={waits} "
          f"freed_memory_stays={freed_memory_stays()} position={env.rank} group_rank={dist.get_rank()}", flush=True)


if __name__ == "__main__":
    main(preset="galaxy", train_fn=train, script="launch_target.py")
