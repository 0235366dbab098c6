"""Parallel efficiency: 2 ranks x 1 thread per plan against 1 process x 2 threads, same batch.

all-MiniLM-L6-v2 with a 4-class head (checkpoint dropout), one global batch of real sentences
(bench/ddp_vs_galaxy.make_batch) padded to --pad_size, AdamW; one step = forward, backward,
gradient sync, AdamW, zero_grad. For each global batch size (default 1 4 16):

  serial    one process, 2 threads (galaxy's serial model)
  tp, sp, galaxy, megatron, dp     world 2 over gloo, 1 thread per rank (megatron: the galaxy
            plan with even shares; galaxy: uneven token shares 74 / 54 and heads 7 / 5, as a
            planner might give two unequal devices; dp: DDP over 2 replicas, batch 1 impossible)

Each configuration runs --blocks times, in blocks that alternate (serial, world 2, serial, ...),
each block --warmup + --steps steps; the figure is the median step over all its blocks, and the
ratio world-2 plan / serial (> 1: the two ranks are slower than one process using both cores).
With --trace DIR, one step per plan and batch runs under torch.profiler: its trace is written per
rank, and rank 0's self CPU time is split into collectives (issuing and waiting), matmul, copies
(padding, concatenation, layout changes) and other.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/parallel_efficiency.py [--batches 1 4 16]
        [--plans tp sp galaxy megatron dp] [--steps 4] [--warmup 1] [--blocks 2] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from ddp_vs_galaxy import NUM_LABELS, make_batch  # noqa: E402
from two_ranks import spawn_two  # noqa: E402

PLANS = {"tp": ("tp", None), "sp": ("sp", None), "megatron": ("galaxy", None),
         "galaxy": ("galaxy", ((7, 5), (896, 640), (74, 54))), "dp": ("dp", None)}


CATEGORIES = (   # (category, name fragments) of torch.profiler's CPU ops, first match wins
    ("collectives", ("c10d", "gloo", "nccl", "all_reduce", "allreduce", "all_gather", "allgather",
                     "reduce_scatter", "broadcast", "barrier", "wait")),
    ("matmul", ("mm", "addmm", "bmm", "linear", "matmul", "scaled_dot_product", "attention")),
    ("copies", ("copy_", "cat", "pad", "clone", "contiguous", "narrow", "split", "index")),
)


def where_time_goes(prof) -> dict[str, float]:
    """Self CPU seconds of one traced step by category: collectives (issuing them and waiting),
    matmul (GEMMs and attention), copies (padding, concatenation, layout), other (element-wise,
    optimizer, autograd)."""
    out = {name: 0.0 for name, _ in CATEGORIES} | {"other": 0.0}
    for e in prof.key_averages():
        name = e.key.lower()
        cat = next((c for c, frags in CATEGORIES if any(f in name for f in frags)), "other")
        out[cat] += e.self_cpu_time_total / 1e6
    return out


def serial_times(args, batch_size: int) -> list[float]:
    from galaxy.train.optim import build_optimizer
    from galaxy.distributed.group import GalaxyGroup
    from galaxy.models.shape import read_model_shape
    from galaxy.plan import Plan
    from galaxy.runtime.assemble import build_model
    torch.set_num_threads(2)
    shape = read_model_shape(args.model_path)
    group = GalaxyGroup.serial(shape["num_attention_heads"], shape["intermediate_size"], args.pad_size)
    torch.manual_seed(0)
    model = build_model(args.model_path, Plan(), group, num_labels=NUM_LABELS, seed=0).train()
    opt = build_optimizer("adamw", model.parameters(), lr=1e-5)
    batch = make_batch(args.model_path, batch_size, args.pad_size)
    times = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        model(**batch)[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    return times


def serial_worker(args, batch_size: int, results) -> None:
    results.put(serial_times(args, batch_size))


def world2_worker(rank: int, args, plan: str, batch_size: int, init_method: str, results) -> None:
    from galaxy.train.optim import build_optimizer
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    from galaxy.runtime import cpu_allocator
    cpu_allocator.keep_freed_memory()      # as training does (config key cpu_allocator, default "keep")
    from galaxy.distributed import waiting
    waiting.set_polling(waiting.choose_poll(args.comm_wait, "gloo", 2, os.cpu_count() or 1))
    from galaxy.distributed.mesh import make_mesh
    from galaxy.models.shape import read_model_shape
    from galaxy.plan import Plan, Workload
    from galaxy.runtime.runners import build_runner
    shape = read_model_shape(args.model_path)
    preset, shares = PLANS[plan]
    if preset == "dp":
        plan_ = Plan(dp=2, comm_chunks=args.comm_chunks)
    else:
        heads, columns, tokens = shares or (None, None, None)
        plan_ = Plan.preset(preset, heads=heads, columns=columns, tokens=tokens, comm_chunks=args.comm_chunks)
    plan_ = plan_.resolve(2, Workload.of(shape, args.pad_size))
    torch.manual_seed(0)
    runner = build_runner(args.model_path, plan_, make_mesh(plan_), num_labels=NUM_LABELS, seed=0)
    opt = build_optimizer("adamw", runner.parameters(), lr=1e-5)
    batch = make_batch(args.model_path, batch_size, args.pad_size)
    if preset == "dp":
        half = batch_size // 2
        batch = {k: v[rank * half:(rank + 1) * half] for k, v in batch.items()}
    times, split = [], None
    for i in range(args.warmup + args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        if args.trace and i == args.warmup:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                runner.step(batch)
                opt.step()
                opt.zero_grad(set_to_none=True)
            Path(args.trace).mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(f"{args.trace}/{plan}-b{batch_size}-rank{rank}.json")
            split = where_time_goes(prof)
        else:
            runner.step(batch)
            opt.step()
            opt.zero_grad(set_to_none=True)
        elapsed = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i >= args.warmup:
            times.append(elapsed.item())
    if rank == 0:
        results.put((times, split))
    dist.destroy_process_group()


def run_serial(ctx, args, b) -> list[float]:
    q = ctx.Queue()
    p = ctx.Process(target=serial_worker, args=(args, b, q))
    p.start()
    out = q.get()
    p.join()
    return out


def run_world2(ctx, args, plan, b) -> tuple[list[float], dict | None]:
    return spawn_two(world2_worker, args, plan, b)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model_path", default=str(ROOT / "models" / "all-MiniLM-L6-v2"))
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--plans", nargs="+", default=list(PLANS), choices=list(PLANS))
    p.add_argument("--pad_size", type=int, default=128)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--comm_chunks", type=int, default=1)
    p.add_argument("--comm_wait", default="auto", choices=("auto", "poll", "block"),
                   help="how ranks wait for collectives (config key comm_wait)")
    p.add_argument("--trace", default=None, help="folder for one step's torch.profiler trace per rank")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    rows = {}
    for b in args.batches:
        plans = [pl for pl in args.plans if not (pl == "dp" and b % 2)]
        times = {"serial": [], **{pl: [] for pl in plans}}
        splits = {}
        for _ in range(args.blocks):
            for pl in plans:                        # serial before each plan: alternating blocks
                times["serial"] += run_serial(ctx, args, b)
                ts, split = run_world2(ctx, args, pl, b)
                times[pl] += ts
                splits[pl] = split or splits.get(pl)
        serial = statistics.median(times["serial"])
        rows[b] = {name: {"median_s": statistics.median(ts), "ratio_vs_serial": statistics.median(ts) / serial}
                   for name, ts in times.items()}
        line = "  ".join(f"{n} {r['median_s'] * 1e3:7.1f} ms (x{r['ratio_vs_serial']:.2f})" for n, r in rows[b].items())
        print(f"batch {b:3d}: {line}", flush=True)
        for pl, split in splits.items():
            if split:
                rows[b][pl]["where_s"] = split
                print(f"    {pl} rank 0, one traced step (self CPU s): "
                      + ", ".join(f"{k} {v:.3f}" for k, v in split.items()), flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
