"""Paired step times of the overlap settings: comm_chunks 1 / 2 / 4, batch_streams 1 / 2, gradient
sync early or not.

World 2 over gloo (one thread per rank), all-MiniLM-L6-v2 with a 4-class head (checkpoint
dropout), one global batch of real sentences padded to --pad_size, AdamW. Every variant is a
runner of its own in the same two processes, built from the same weights; one step is
runner.step + AdamW + zero_grad, timed on the slower rank. After --warmup steps each, rounds run
every variant once in an order that reverses each round, so machine noise hits them alike; the
figure per variant is the median over rounds of its step time divided by its baseline's in the
same round (paired ratio), next to the median and min step times.

Variants (name: plan, comm_chunks, batch_streams, gradient sync started during backward):
  galaxy-c1 (baseline of the galaxy-*), galaxy-c2, galaxy-c4: ATT TP, MLP TP, CON SP, even shares
  galaxy-s2, galaxy-s2-c2: the same, each micro-batch's rows in 2 batch streams (plain, and with
      comm_chunks 2 inside each stream's sub-blocks)
  galaxy-s3, galaxy-s4: in 3 and 4 streams, every other stream a step out of phase (streams.
      stream_delays); galaxy-s4-c2: 4 streams, comm_chunks 2 in each; galaxy-s3-inphase: 3 streams all in phase (the schedule before the delays)
  galaxy-c1-gloo, galaxy-c4-gloo, galaxy-s4-gloo: galaxy-c1, -c4 and -s4 with gloo's own all-gather
      and all-to-all, as before galaxy.distributed.pair_exchange (every other variant exchanges)
  tp-c1 (baseline of the tp-*), tp-c2, tp-c4:                    ATT TP, MLP TP, CON None
  tp-s2, tp-s2-c2:                                               the same in 2 batch streams
  sp-sync-after (baseline of sp-early), sp-early:               ATT SP, MLP SP, CON SP
  sp-kv-after-gather (baseline of sp-kv-blocks), sp-kv-blocks:  ATT SP, MLP SP, CON SP; the
      attention to the rank's own keys runs after the K/V all-gather, or while it travels
      (config key kv_blocks, galaxy.layers.attention_blocks; every other variant attends after
      the gather, the default). The blocks need --dropout 0: the fused kernel draws no dropout
Every variant's waits block (work.wait()), but galaxy-c1-poll's and tp-c1-poll's, which poll
(galaxy.distributed.waiting, what comm_wait auto picks when each rank has a core): the two wait
modes paired on one plan.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/overlap_paired.py [--variants ...] [--batch_size 8]
        [--pad_size 128] [--rounds 8] [--warmup 2] [--dropout P] [--pin [--competitor]] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ddp_vs_galaxy import NUM_LABELS, make_batch  # noqa: E402
from two_ranks import add_rank_args, run_two  # noqa: E402
from galaxy.distributed import pair_exchange, streams, waiting  # noqa: E402
from galaxy.models import family  # noqa: E402

class Variant(NamedTuple):
    preset: str
    baseline: str                 # the variant its paired ratio is taken against
    comm_chunks: int = 1
    early_sync: bool = True       # the gradient sync's buckets start during backward
    poll: bool = False            # waits poll (else block)
    kv_blocks: bool = False
    batch_streams: int = 1
    in_phase: bool = False        # streams all in phase (no stream_delays)
    paired: bool = True           # two-rank gather / scatter by pair_exchange (False: gloo's own)


VARIANTS = {
    "galaxy-c1": Variant("galaxy", "galaxy-c1"),
    "galaxy-c2": Variant("galaxy", "galaxy-c1", comm_chunks=2),
    "galaxy-c4": Variant("galaxy", "galaxy-c1", comm_chunks=4),
    "galaxy-c1-poll": Variant("galaxy", "galaxy-c1", poll=True),
    "galaxy-s2": Variant("galaxy", "galaxy-c1", batch_streams=2),
    "galaxy-s2-c2": Variant("galaxy", "galaxy-c1", comm_chunks=2, batch_streams=2),
    "galaxy-s3": Variant("galaxy", "galaxy-c1", batch_streams=3),
    "galaxy-s4": Variant("galaxy", "galaxy-c1", batch_streams=4),
    "galaxy-s4-c2": Variant("galaxy", "galaxy-c1", comm_chunks=2, batch_streams=4),
    "galaxy-s3-inphase": Variant("galaxy", "galaxy-c1", batch_streams=3, in_phase=True),
    "galaxy-c1-gloo": Variant("galaxy", "galaxy-c1", paired=False),
    "galaxy-c4-gloo": Variant("galaxy", "galaxy-c1", comm_chunks=4, paired=False),
    "galaxy-s4-gloo": Variant("galaxy", "galaxy-c1", batch_streams=4, paired=False),
    "tp-c1": Variant("tp", "tp-c1"),
    "tp-c2": Variant("tp", "tp-c1", comm_chunks=2),
    "tp-c4": Variant("tp", "tp-c1", comm_chunks=4),
    "tp-c1-poll": Variant("tp", "tp-c1", poll=True),
    "tp-s2": Variant("tp", "tp-c1", batch_streams=2),
    "tp-s2-c2": Variant("tp", "tp-c1", comm_chunks=2, batch_streams=2),
    "sp-sync-after": Variant("sp", "sp-sync-after", early_sync=False),
    "sp-early": Variant("sp", "sp-sync-after"),
    "sp-kv-after-gather": Variant("sp", "sp-kv-after-gather"),
    "sp-kv-blocks": Variant("sp", "sp-kv-after-gather", kv_blocks=True),
}


def build(args, name: str, shape: dict):
    from galaxy.train.optim import build_optimizer
    from galaxy.distributed.mesh import make_mesh
    from galaxy.plan import Plan, Workload
    from galaxy.runtime.runners import build_runner
    v = VARIANTS[name]
    plan = Plan.preset(v.preset, comm_chunks=v.comm_chunks, kv_blocks=v.kv_blocks, batch_streams=v.batch_streams)
    plan = plan.resolve(2, Workload.of(shape, args.pad_size))
    torch.manual_seed(0)
    runner = build_runner(args.model_path, plan, make_mesh(plan), num_labels=NUM_LABELS, seed=0, dropout=args.dropout)
    runner.sync.overlap = v.early_sync
    runner.optimizer = build_optimizer("adamw", runner.parameters(), lr=1e-5)
    return runner


def in_phase(n: int) -> list[int]:
    return [0] * n


def train_step(runner, batch, v: Variant) -> float:
    waiting.set_polling(v.poll)
    family.stream_delays = in_phase if v.in_phase else streams.stream_delays
    pair_exchange.enabled = pair_exchange.over_loopback = v.paired      # paired on loopback too
    dist.barrier()
    t0 = time.perf_counter()
    runner.step(batch)
    runner.optimizer.step()
    runner.optimizer.zero_grad(set_to_none=True)
    elapsed = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)          # the step ends when the slower rank does
    return elapsed.item()


def worker(rank: int, args, init_method: str, results) -> None:
    if args.pin:
        os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    from galaxy.runtime import cpu_allocator
    cpu_allocator.keep_freed_memory()      # as training does (config key cpu_allocator, default "keep")
    from galaxy.models.shape import read_model_shape
    shape = read_model_shape(args.model_path)
    runners = {name: build(args, name, shape) for name in args.variants}
    batch = make_batch(args.model_path, args.batch_size, args.pad_size)
    times = {name: [] for name in args.variants}
    for _ in range(args.warmup):
        for name in args.variants:
            train_step(runners[name], batch, VARIANTS[name])
    order = list(args.variants)
    for i in range(args.rounds):
        for name in order if i % 2 == 0 else order[::-1]:
            times[name].append(train_step(runners[name], batch, VARIANTS[name]))
    if rank == 0:
        results.put(times)
    dist.barrier()
    dist.destroy_process_group()


def summarise(times: dict) -> dict:
    out = {}
    for name, ts in times.items():
        base = VARIANTS[name].baseline
        ratios = [t / b for t, b in zip(ts, times[base])] if base in times else []
        out[name] = {"median_ms": 1e3 * statistics.median(ts), "min_ms": 1e3 * min(ts),
                     "paired_ratio": statistics.median(ratios) if ratios else None, "baseline": base,
                     "times_s": ts}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model_path", default=str(ROOT / "models" / "all-MiniLM-L6-v2"))
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--pad_size", type=int, default=128)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dropout", type=float, default=None,
                   help="every dropout of the model (default: the checkpoint's). The K/V blocks need 0: the "
                        "fused kernel draws no dropout, so with the checkpoint's 0.1 sp-kv-blocks attends once")
    p.add_argument("--pin", action="store_true", help="pin rank r to core r")
    p.add_argument("--competitor", action="store_true",
                   help="a CPU-bound process pinned beside rank 1 on core 1 for the whole run (with --pin)")
    p.add_argument("--json", default=None)
    add_rank_args(p)
    args = p.parse_args()
    competitor = None
    if args.competitor:
        import subprocess
        competitor = subprocess.Popen([sys.executable, "-c", "import os; os.sched_setaffinity(0, {1}); exec('while True: pass')"])
    try:
        times = run_two(worker, args)
    finally:
        if competitor is not None:
            competitor.kill()
            competitor.wait()
    if times is None:          # a testbed rank other than 0: rank 0 reports
        return
    rows = summarise(times)
    print(f"world 2 x {args.threads} thread, all-MiniLM-L6-v2, batch {args.batch_size} x {args.pad_size}, "
          f"{args.rounds} rounds after {args.warmup} warm-up")
    print(f"{'variant':>18} | {'median ms':>9} {'min ms':>8} | {'paired vs':>18} {'ratio':>6}")
    for name, r in rows.items():
        ratio = "" if r["paired_ratio"] is None else f"{r['paired_ratio']:.3f}"
        print(f"{name:>18} | {r['median_ms']:>9.1f} {r['min_ms']:>8.1f} | {r['baseline']:>18} {ratio:>6}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
