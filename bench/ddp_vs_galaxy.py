"""DDP against a Galaxy plan on two processes: step time and bytes communicated per step.

The same model (all-MiniLM-L6-v2 with a 4-class head, checkpoint dropout) and the same global
batch of real sentences (pydoc topics, padded to --pad_size) train in two ways on world 2:

  ddp     dp 2 x Galaxy 1: each rank runs half the batch on a whole model; DDP all-reduces the
          gradients (one bucketed all-reduce of every parameter per step)
  galaxy  dp 1 x Galaxy 2 under --plan (default galaxy: ATT TP, CON SP, MLP TP, even shares): both
          ranks run the whole batch on half the heads / columns / tokens; activations move
  galaxy-sN  the same plan with batch_streams N (--batch_streams 1 2: both, side by side; one
          stream's collectives travel while the other's sub-block computes)

for each global batch size (default 1 2 4 8 16; DDP cannot split a batch of 1 over two replicas).
One step = runner.step (forward, backward, gradient sync) + AdamW + zero_grad. After --warmup
steps, --steps measured steps alternate between the two runs (ddp, galaxy, galaxy, ddp, ...) so
machine noise hits both; a step's time is the slower rank's. Bytes are what one rank sends per step
in the ring convention of galaxy.profiler.comm (all-reduce of E bytes over N ranks: 2(N-1)E/N),
counted by the recorder that every galaxy collective, GradientSync and DDP's comm hook report to;
the scalar loss reductions for reporting are not counted.

Prints a side-by-side table and draws the curves (step time, bytes) into --png. --terms adds, per
batch and mode, one more step broken into its terms on each rank (bench/step_terms.py: kernels,
Python, blocked in communication or waiting for the peer).

    HF_HUB_OFFLINE=1 .venv/bin/python bench/ddp_vs_galaxy.py [--batches 1 2 4 8 16] [--steps 6]
        [--batch_streams 1 2] [--terms] [--png runs/bench/ddp_vs_galaxy.png] [--json out.json]
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

from step_terms import print_terms  # noqa: E402
from two_ranks import add_rank_args, run_two  # noqa: E402

NUM_LABELS = 4


def modes_of(batch_streams: list[int]) -> list[str]:
    """ddp, then one Galaxy mode per stream count: galaxy (1 stream), galaxy-s2, ..."""
    return ["ddp"] + ["galaxy" if s == 1 else f"galaxy-s{s}" for s in batch_streams]


def make_batch(model_dir: str, batch_size: int, pad_size: int) -> dict[str, torch.Tensor]:
    """Real sentences of varied length: paragraphs of Python's pydoc topics."""
    from pydoc_data.topics import topics
    from transformers import AutoTokenizer
    paras = [" ".join(p.split()) for text in topics.values() for p in text.split("\n\n")]
    paras = [p for p in paras if len(p) > 40]
    texts = [paras[i * 7][: 60 + 45 * i] for i in range(batch_size)]
    enc = AutoTokenizer.from_pretrained(model_dir)(texts, padding="max_length", truncation=True,
                                                   max_length=pad_size, return_tensors="pt")
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
            "token_type_ids": enc["token_type_ids"], "labels": torch.arange(batch_size) % NUM_LABELS}


def build_runners(args, shape: dict) -> dict:
    from galaxy.train.optim import build_optimizer
    from galaxy.distributed.mesh import make_mesh
    from galaxy.plan import Plan, Workload
    from galaxy.runtime.runners import build_runner
    work = Workload.of(shape, args.pad_size)
    plans = {"ddp": Plan(dp=2).resolve(2, work)}
    for mode, streams in zip(modes_of(args.batch_streams)[1:], args.batch_streams):
        plans[mode] = Plan.preset(args.plan, batch_streams=streams).resolve(2, work)
    runners = {}
    for mode in plans:
        runner = build_runner(args.model_path, plans[mode], make_mesh(plans[mode]), num_labels=NUM_LABELS, seed=0)
        runner.optimizer = build_optimizer("adamw", runner.parameters(), lr=1e-5)
        runners[mode] = runner
    return runners


def local_rows(mode: str, batch: dict) -> dict:
    if mode != "ddp":
        return batch
    half = batch["labels"].shape[0] // 2
    rank = dist.get_rank()
    return {k: v[rank * half:(rank + 1) * half] for k, v in batch.items()}


def one_step(runner, batch) -> None:
    runner.step(batch)
    runner.optimizer.step()
    runner.optimizer.zero_grad(set_to_none=True)


def train_step(runner, batch) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    one_step(runner, batch)
    elapsed = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)          # the step ends when the slower rank does
    return elapsed.item()


def comm_per_step(runner, batch):
    """(bytes this rank sends, collectives it takes part in) in one step."""
    from galaxy.profiler.comm import CommRecorder
    with CommRecorder() as rec:
        runner.step(batch)
    runner.optimizer.zero_grad(set_to_none=True)
    total = rec.stats.total()
    return total.sent, total.calls


def measure(args, runners: dict, batch_size: int) -> dict:
    full = make_batch(args.model_path, batch_size, args.pad_size)
    modes = [m for m in runners if not (m == "ddp" and batch_size % 2)]
    out = {m: dict(zip(("bytes", "calls"), comm_per_step(runners[m], local_rows(m, full))), times=[])
           for m in modes}
    for _ in range(args.warmup):
        for m in modes:
            train_step(runners[m], local_rows(m, full))
    for i in range(args.steps):
        for m in modes if i % 2 == 0 else modes[::-1]:
            out[m]["times"].append(train_step(runners[m], local_rows(m, full)))
    rows = {m: {"step_ms": 1e3 * statistics.median(r["times"]), "min_ms": 1e3 * min(r["times"]),
                "mb_per_step": r["bytes"] / 1e6, "collectives": r["calls"]} for m, r in out.items()}
    if args.terms:
        from galaxy.distributed import waiting
        from step_terms import all_ranks_terms
        poll = waiting.polling()
        for m in modes:
            rows[m]["terms"] = all_ranks_terms(lambda: one_step(runners[m], local_rows(m, full)), waiting.set_polling)
        waiting.set_polling(poll)
    return rows


def worker(rank: int, args, init_method: str, results) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    from galaxy.runtime import cpu_allocator
    cpu_allocator.keep_freed_memory()      # as training does (config key cpu_allocator, default "keep")
    from galaxy.distributed import waiting
    waiting.set_polling(waiting.choose_poll(args.comm_wait, "gloo", 2, os.cpu_count() or 1))
    from galaxy.models.shape import read_model_shape
    runners = build_runners(args, read_model_shape(args.model_path))
    rows = {}
    for b in args.batches:
        rows[b] = measure(args, runners, b)
        if rank == 0:
            print(f"  batch {b:3d} done", flush=True)
    if rank == 0:
        results.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def crossover(rows: dict, key: str, mode: str = "galaxy") -> str:
    """Where the `mode` and DDP curves cross: interpolated between measured batch sizes, or
    extrapolated linearly from the last two when they do not cross in the measured range."""
    pts = [(b, r[mode][key] - r["ddp"][key]) for b, r in rows.items() if "ddp" in r]
    if len(pts) < 2:
        return "needs two batch sizes that DDP can run"
    for (b0, d0), (b1, d1) in zip(pts, pts[1:]):
        if (d0 < 0) != (d1 < 0):
            x = b0 + (b1 - b0) * d0 / (d0 - d1)
            return f"curves cross between batch {b0} and {b1} (about {x:.1f})"
    (b0, d0), (b1, d1) = pts[-2:]
    lower = "Galaxy" if d1 < 0 else "DDP"
    slope = (d1 - d0) / (b1 - b0)
    if slope == 0 or (d1 < 0) == (slope < 0):
        return f"{lower} lower at every measured batch size, and not closing"
    return (f"{lower} lower at every measured batch size; linear extrapolation crosses at "
            f"batch {b1 - d1 / slope:.1f}")


def print_table(rows: dict, plan: str) -> None:
    """One line per batch and Galaxy mode: its step (median / min) and bytes against DDP's."""
    print(f"\nworld 2, all-MiniLM-L6-v2; DDP (dp 2) vs Galaxy plan '{plan}' (Galaxy group of 2)")
    print(f"{'batch':>5} {'mode':>10} | {'DDP ms':>15} {'Galaxy ms':>15} {'G/D':>5} | "
          f"{'DDP MB/step':>11} {'Galaxy MB/step':>14} {'G/D':>5}")
    print("-" * 92)
    galaxy_modes = [m for m in next(iter(rows.values())) if m != "ddp"]
    for b, row in rows.items():
        d = row.get("ddp")
        for m in galaxy_modes:
            g = row[m]
            g_ms = f"{g['step_ms']:.1f} / {g['min_ms']:.1f}"
            if d is None:
                print(f"{b:>5} {m:>10} | {'n/a':>15} {g_ms:>15} {'':>5} | {'n/a':>11} {g['mb_per_step']:>14.2f}")
                continue
            d_ms = f"{d['step_ms']:.1f} / {d['min_ms']:.1f}"
            print(f"{b:>5} {m:>10} | {d_ms:>15} {g_ms:>15} {g['step_ms'] / d['step_ms']:>5.2f} | "
                  f"{d['mb_per_step']:>11.2f} {g['mb_per_step']:>14.2f} {g['mb_per_step'] / d['mb_per_step']:>5.2f}")
    print("(ms: median / min; n/a: a global batch of 1 cannot be split over 2 data-parallel replicas)")
    for m in galaxy_modes:
        print(f"crossover with {m}, step time: {crossover(rows, 'step_ms', m)}")
        print(f"crossover with {m}, bytes:     {crossover(rows, 'mb_per_step', m)}")


def draw(rows: dict, path: str, plan: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "step_ms", "step time (ms, median)"),
                           (axes[1], "mb_per_step", "MB sent per rank per step")):
        for mode in dict.fromkeys(m for r in rows.values() for m in r):     # DDP has no batch 1
            name = "DDP (dp 2)" if mode == "ddp" else f"Galaxy '{plan}' {mode} (group of 2)"
            pts = [(b, r[mode][key]) for b, r in rows.items() if mode in r]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(rows), [str(b) for b in rows])
        ax.set_xlabel("global batch size")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("all-MiniLM-L6-v2, world 2 (gloo): DDP vs Galaxy")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model_path", default=str(ROOT / "models" / "all-MiniLM-L6-v2"))
    p.add_argument("--plan", default="galaxy", choices=("galaxy", "galaxy2", "tp", "sp"))
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--batch_streams", type=int, nargs="+", default=[1],
                   help="one Galaxy mode per value (plan key batch_streams), measured side by side")
    p.add_argument("--terms", action="store_true", help="one more step per batch and mode, broken into its terms")
    p.add_argument("--pad_size", type=int, default=128)
    p.add_argument("--comm_wait", default="auto", choices=("auto", "poll", "block"),
                   help="how ranks wait for collectives (config key comm_wait)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2), help="torch threads per rank")
    p.add_argument("--png", default=str(ROOT / "runs" / "bench" / "ddp_vs_galaxy.png"))
    p.add_argument("--json", default=None)
    add_rank_args(p)
    args = p.parse_args()
    if any(s < 1 for s in args.batch_streams) or len(set(args.batch_streams)) != len(args.batch_streams):
        p.exit(2, f"--batch_streams: distinct integers of at least 1 (got {args.batch_streams}); e.g. --batch_streams 1 2\n")

    print(f"measuring {args.steps} steps per batch size after {args.warmup} warm-up steps, "
          f"{args.threads} thread(s) per rank ...", flush=True)
    rows = run_two(worker, args)
    if rows is None:           # a testbed rank other than 0: rank 0 reports
        return
    print_table(rows, args.plan)
    if args.terms:
        print_terms({f"b{b} {m}": r["terms"] for b, row in rows.items() for m, r in row.items()})
    if args.png:
        draw(rows, args.png, args.plan)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({str(b): r for b, r in rows.items()}, f, indent=1)


if __name__ == "__main__":
    main()
