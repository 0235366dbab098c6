"""Message sizes: the two-rank paired exchange (receive posted first) against gloo's own collectives.

galaxy.distributed.pair_exchange exists for shaped links, where gloo's send-first order serialises
the two directions of messages of hundreds of KB (bench/link_collectives.py). A small message is
latency, not rate, and the exchange's two point-to-point works may cost more than one gloo
collective. This bench times both by size: world 2 over gloo, one thread per rank, the engine's
own calls (collectives.all_gather_sequence of a [1, s, h] shard, reduce_scatter_sequence of a
[1, 2s, h] tensor; each rank sends `kb` KB), each path forced:
  gloo    pair_exchange.enabled = False: gloo's all-gather, the all-to-all reduce-scatter
  paired  pair_exchange.enabled and over_loopback: the exchange, on loopback too
Per size and primitive, --rounds rounds; in each, both paths run --calls calls back to back (as
the layers call them), which path first alternating by round. A round's figure is the slower
rank's mean per call; printed: the median over rounds per path, paired / gloo of the medians and
the median of the rounds' paired / gloo (ratios < 1: the exchange is faster).

    .venv/bin/python bench/pair_exchange_sizes.py [--sizes 1 4 16 64 256 1024] [--rounds 15] [--calls 20]
        [--json out.json]
or on the edge testbed (shaped link), as bench/two_ranks.py describes:
    flock /work/testbed.lock timeout 600 .venv/bin/python -m galaxy.edge run --shield \\
        --cluster clusters/two_equal_1g.json -- .venv/bin/python bench/pair_exchange_sizes.py
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from two_ranks import add_rank_args, run_two  # noqa: E402
from galaxy.distributed import collectives, pair_exchange  # noqa: E402

PATHS = ("gloo", "paired")
PRIMITIVES = ("all_gather", "reduce_scatter")


def use(path: str) -> None:
    pair_exchange.enabled = pair_exchange.over_loopback = path == "paired"


def call(primitive: str, kb: int, rank: int):
    """A function making one call of `primitive`, each rank sending kb KB of fp32."""
    numel = kb * 1024 // 4
    h = min(numel, 256)
    s = numel // h
    sizes, pg = (s, s), dist.group.WORLD
    if primitive == "all_gather":
        shard = torch.randn(1, s, h)                         # (b, s_rank, h)
        return lambda: collectives.all_gather_sequence(shard, sizes, pg)
    full = torch.randn(1, 2 * s, h)                          # (b, S, h): one block of s tokens to the peer
    return lambda: collectives.reduce_scatter_sequence(full, sizes, rank, pg)


def per_call_s(fn, calls: int) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def worker(rank: int, args, init_method: str, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    rows = []
    for primitive in args.primitives:
        for kb in args.sizes:
            fn = call(primitive, kb, rank)
            for path in PATHS:                              # warm both: buffers, the size on each connection
                use(path)
                per_call_s(fn, 3)
            times = {p: [] for p in PATHS}
            for r in range(args.rounds):
                for path in (PATHS if r % 2 == 0 else PATHS[::-1]):
                    use(path)
                    times[path].append(per_call_s(fn, args.calls))
            both = [None, None]
            dist.all_gather_object(both, times)
            if rank == 0:
                rows.append(row(primitive, kb, both))
    if rank == 0:
        results.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def row(primitive: str, kb: int, both: list[dict]) -> dict:
    slower = {p: [max(a, b) for a, b in zip(both[0][p], both[1][p])] for p in PATHS}
    med = {p: statistics.median(slower[p]) for p in PATHS}
    paired = statistics.median(b / a for a, b in zip(slower["gloo"], slower["paired"]))
    out = {"primitive": primitive, "kb": kb, "gloo_us": med["gloo"] * 1e6, "paired_us": med["paired"] * 1e6,
           "ratio_of_medians": med["paired"] / med["gloo"], "median_ratio": paired, "rounds": slower}
    print(f"{primitive:>15} {kb:>6} | {out['gloo_us']:>9.0f} {out['paired_us']:>9.0f} | "
          f"{out['ratio_of_medians']:>8.3f} {paired:>8.3f}", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", nargs="+", type=int, default=[1, 4, 16, 64, 256, 1024], help="KB each rank sends")
    p.add_argument("--primitives", nargs="+", default=list(PRIMITIVES), choices=PRIMITIVES)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=20, help="calls back to back per path in a round")
    p.add_argument("--json", default=None)
    add_rank_args(p)
    args = p.parse_args()
    print(f"{'primitive':>15} {'KB':>6} | {'gloo us':>9} {'paired us':>9} | {'p/g med':>8} {'med p/g':>8}", flush=True)
    rows = run_two(worker, args)
    if rows is not None and args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
