"""How late a waiting rank learns that its collective finished, per wait mode (config key comm_wait).

Two ranks over gloo, pinned to cores 0 and 1 (taskset), one thread each; with --competitor a
CPU-bound `while True: pass` of equal priority shares core 1 with rank 1 (plan_unequal.py's slow
device). Every round lines the ranks up with a small all-reduce, runs a little compute on both
(four 256 x 384 x 384 GEMMs, as a sub-block ends in a step), then rank 0 computes --late ms longer
and both start an all-reduce of --numel floats, waited for in one of the modes:

  poll   galaxy.distributed.waiting with polling on: is_completed() and sched_yield() in a loop
  block  work.wait(): the thread sleeps until gloo wakes it

Each rank timestamps its start and its return (time.perf_counter: one monotonic clock for the
processes of a host). Printed per mode and rank: how long after the later rank's start the call
returned (median and mean over --rounds; modes alternate every round, so machine noise hits them
alike), and how often rank 1 started first. What the collective itself needs is the same in
every mode; the difference between modes is the waiting.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/wait_modes.py [--late 8] [--numel 196608] [--rounds 40]
        [--competitor]

needs taskset (util-linux) and at least two cores.
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("poll", "block")


def rank_main(rank: int, port: int, late_s: float, numel: int, rounds: int) -> None:
    import torch
    import torch.distributed as dist
    sys.path.insert(0, str(ROOT))
    from galaxy.distributed import waiting

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    x, line_up = torch.zeros(numel), torch.zeros(1)
    a, w = torch.randn(256, 384), torch.randn(384, 384)
    stamps = {m: [] for m in MODES}                     # (start, return) per round
    for r in range(rounds + 1):                          # round 0 warms up
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):
            waiting.set_polling(True)
            waiting.all_reduce(line_up)
            for _ in range(4):
                a @ w
            if rank == 0:                                # rank 0 computes late_s longer
                t = time.perf_counter()
                while time.perf_counter() - t < late_s:
                    pass
            waiting.set_polling(mode == "poll")
            start = time.perf_counter()
            waiting.wait(dist.all_reduce(x, async_op=True))
            if r:
                stamps[mode].append((start, time.perf_counter()))
    waiting.set_polling(False)
    for mode in MODES:
        mine = torch.tensor(stamps[mode], dtype=torch.float64)      # [rounds, 2]
        both = [torch.empty_like(mine) for _ in range(2)]
        dist.all_gather(both, mine)
        if rank == 0:
            later_start = torch.maximum(both[0][:, 0], both[1][:, 0])
            after = [(both[k][:, 1] - later_start) * 1e3 for k in range(2)]
            first = (both[1][:, 0] < both[0][:, 0]).double().mean().item()
            print(f"  {mode:<6} returned after the later start, ms:  "
                  + "  ".join(f"rank {k} median {after[k].median().item():5.2f} mean {after[k].mean().item():5.2f}"
                              for k in range(2))
                  + f"   rank 1 started first in {first:.0%}", flush=True)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--late", type=float, default=8.0, help="ms rank 0 computes longer before the all-reduce")
    p.add_argument("--numel", type=int, default=196608, help="floats all-reduced (196608: 768 KB)")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--competitor", action="store_true", help="a CPU-bound process beside rank 1 on core 1")
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.port, args.late * 1e-3, args.numel, args.rounds)
        return
    if (os.cpu_count() or 1) < 2:
        sys.exit("wait_modes.py needs two cores")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    competitor = subprocess.Popen(["taskset", "-c", "1", sys.executable, "-c", "while True: pass"]) \
        if args.competitor else None
    try:
        port = free_port()
        print(f"late {args.late} ms, {args.numel * 4 / 1024:.0f} KB all-reduce, {args.rounds} rounds, "
              f"{'a competitor on core 1' if competitor else 'quiet'}:", flush=True)
        procs = [subprocess.Popen(["taskset", "-c", str(r), sys.executable, __file__, "--rank", str(r),
                                   "--port", str(port), "--late", str(args.late), "--numel", str(args.numel),
                                   "--rounds", str(args.rounds)], env=env)
                 for r in range(2)]
        codes = [q.wait(timeout=600) for q in procs]
        if any(codes):
            sys.exit(f"a rank exited {codes}")
    finally:
        if competitor is not None:
            competitor.kill()
            competitor.wait()


if __name__ == "__main__":
    main()
