"""Per-rank memory and step time: serial, Galaxy 2, dp 2 and sharded dp 2, each with and without
activation checkpointing.

Models: all-MiniLM-L6-v2 (models/all-MiniLM-L6-v2, real sentences, batch 16 x 256 by default) and a
wider BERT built here from transformers.BertConfig with random weights (hidden 1024, 8 layers, 16
heads, MLP 4096; nothing downloaded; random token ids). Every configuration runs in fresh processes
(gloo over loopback, --threads per rank, CPU unless --device cuda), trains with AdamW through the
same runner the trainer uses (galaxy.runtime.build_runner), and reports per rank (the largest over
ranks; ranks of one configuration hold equal shares):

  weights / grads / optim   MiB this rank stores after a step: parameters (their local slices
                            under dp_sharding), gradients, AdamW's exp_avg + exp_avg_sq; exact,
                            from the tensors
  peak                      MiB at the peak of one step (the second; the first creates AdamW's
                            state) above what the process held before the model was built. CPU:
                            peak RSS of the step minus RSS before the build, with glibc's mmap
                            threshold fixed at 64 KiB so that RSS follows the live tensors (DDP's
                            buckets and FSDP's buffers included, and a few MiB of non-tensor
                            memory); CUDA: max_memory_allocated
  act                       peak - weights - grads - optim: activations, gathered parameters
                            and their gradients (FSDP), DDP's buckets, temporaries
  rss                       CPU: the peak RSS over the timed steps, minus RSS before the build
                            (the peak of several steps; about equal to peak)
  step ms / min ms          median and fastest of --steps after --warmup, outside the memory
                            trace (which slows what it watches; a step ends when the
                            slower rank's does): runner.step + AdamW + zero_grad. "vs none" and the
                            figure use the fastest (least disturbed by other load on the machine)

Configurations: serial (world 1), galaxy2 (Galaxy group of 2, --plan, even shares; world 2),
dp2 (DDP, world 2), dp2-sharded (dp_sharding "full": FSDP2, world 2); each with
activation_checkpointing "none" and "full".

    HF_HUB_OFFLINE=1 .venv/bin/python bench/memory.py [--models minilm wide] [--steps 3] [--warmup 1]
        [--minilm_batch 16 --minilm_pad 256] [--wide_batch 16 --wide_pad 256] [--threads 1]
        [--png runs/bench/memory.png] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

MIB = 2**20
NUM_LABELS = 4
# name -> (world, dp, Galaxy group size, dp_sharding)
MODES = {"serial": (1, 1, 1, "none"), "galaxy2": (2, 1, 2, "none"), "dp2": (2, 2, 1, "none"),
         "dp2-sharded": (2, 2, 1, "full")}
WIDE = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, intermediate_size=4096,
            vocab_size=30522, max_position_embeddings=512)


def write_wide_bert(path: str) -> str:
    """A randomly initialised BertModel of WIDE's shape, saved as a Hugging Face folder."""
    from transformers import BertConfig, BertModel
    torch.manual_seed(0)
    BertModel(BertConfig(**WIDE)).save_pretrained(path)
    return path


def make_inputs(model: str, model_dir: str, batch: int, pad: int) -> dict[str, torch.Tensor]:
    if model == "minilm":
        from ddp_vs_galaxy import make_batch          # real sentences, as the other benches use
        return make_batch(model_dir, batch, pad)
    g = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(1000, WIDE["vocab_size"], (batch, pad), generator=g),
            "attention_mask": torch.ones(batch, pad, dtype=torch.long),
            "token_type_ids": torch.zeros(batch, pad, dtype=torch.long),
            "labels": torch.arange(batch) % NUM_LABELS}


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def stored_bytes(runner, optimizer) -> dict[str, int]:
    from galaxy.parallel.dtensors import local
    params = list(runner.parameters())
    nbytes = lambda t: t.numel() * t.element_size()                      # noqa: E731
    return {"weights": sum(nbytes(local(p)) for p in params),
            "grads": sum(nbytes(local(p.grad)) for p in params if p.grad is not None),
            "optim": sum(nbytes(local(v)) for s in optimizer.state.values() for v in s.values()
                         if torch.is_tensor(v) and v.dim() > 0)}


class MemoryTrace:
    """Peak memory of the `measured()` block above what the process held before the model was
    built. CPU: resident set size (Linux /proc: VmRSS before, the high-water mark VmHWM reset at
    the block's start and read at its end); run_config starts the ranks with glibc's mmap
    threshold fixed at 64 KiB, so freed tensors go back to the system at once and RSS follows the
    tensors alive (torch.profiler's memory events miss frees of FSDP's resized storages, so they
    cannot be used). CUDA: the allocator's max_memory_allocated."""

    def __init__(self, device):
        self.device, self.base, self.high = device, 0, 0

    def __enter__(self):
        if self.device.type == "cpu":
            self.base = _rss_kib("VmRSS") * 1024
        return self

    def __exit__(self, *exc):
        return None

    @contextmanager
    def measured(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _reset_peak_rss()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.high = torch.cuda.max_memory_allocated(self.device)
        else:
            self.high = _rss_kib("VmHWM") * 1024 - self.base

    def peak(self) -> int:
        return self.high


def worker(rank: int, world: int, port: int, args, model: str, model_dir: str, mode: str, ckpt: str, results):
    from galaxy.train.optim import build_optimizer
    torch.set_num_threads(args.threads)
    device = torch.device(args.device if args.device == "cpu" else f"cuda:{rank}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    from galaxy.distributed.mesh import make_mesh
    from galaxy.models.shape import read_model_shape
    from galaxy.plan import Plan, Workload
    from galaxy.runtime.runners import build_runner

    _, dp, group, sharding = MODES[mode]
    batch_size, pad = (args.minilm_batch, args.minilm_pad) if model == "minilm" else (args.wide_batch, args.wide_pad)
    shape = read_model_shape(model_dir)
    full = make_inputs(model, model_dir, batch_size, pad)
    with MemoryTrace(device) as trace:
        methods = Plan.preset(args.plan) if group > 1 else Plan()
        plan = Plan(methods.att, methods.mlp, methods.con, dp=dp, checkpoint=ckpt, dp_sharding=sharding)
        plan = plan.resolve(dp * group, Workload.of(shape, pad))
        mesh = make_mesh(plan)
        runner = build_runner(model_dir, plan, mesh, num_labels=NUM_LABELS, seed=0, device=device, dropout=0.0)
        runner.train()
        optimizer = build_optimizer("adamw", runner.parameters(), lr=1e-5)
        rows = batch_size // dp
        batch = {k: v[mesh.dp_rank * rows:(mesh.dp_rank + 1) * rows].to(device) for k, v in full.items()}

        def step():
            runner.step(batch)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        step()                      # AdamW's state exists from here on
        with trace.measured():      # the step whose peak is reported; gradients kept to count them
            runner.step(batch)
            optimizer.step()
        held = stored_bytes(runner, optimizer)
        optimizer.zero_grad(set_to_none=True)
    peak = trace.peak()
    _reset_peak_rss()

    def timed() -> float:
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = torch.tensor(time.perf_counter() - t0, dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return elapsed.item()

    for _ in range(args.warmup):
        timed()
    times = [timed() for _ in range(args.steps)]
    rss = _rss_kib("VmHWM") * 1024 - trace.base
    out = {"rank": rank, **held, "peak": peak, "rss": rss,
           "step_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times)}
    results.put(out)
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_config(args, model: str, model_dir: str, mode: str, ckpt: str) -> dict:
    world = MODES[mode][0]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    # Large blocks straight from mmap and back at free: RSS then follows the live tensors (CPU).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, world, port, args, model, model_dir, mode, ckpt, results))
             for r in range(world)]
    for p in procs:
        p.start()
    ranks = [results.get(timeout=args.timeout) for _ in range(world)]
    for p in procs:
        p.join(timeout=60)
    if any(p.exitcode for p in procs):
        raise RuntimeError(f"{model} {mode} {ckpt}: a rank failed (exit codes {[p.exitcode for p in procs]})")
    row = {k: max(r[k] for r in ranks) for k in ("weights", "grads", "optim", "peak", "rss", "step_ms", "min_ms")}
    row["act"] = row["peak"] - row["weights"] - row["grads"] - row["optim"]
    return {"model": model, "mode": mode, "ckpt": ckpt, "world": world, **row}


def load_rows(path: str) -> list[dict]:
    return json.loads(Path(path).read_text())["rows"]


def print_table(rows: list[dict], args) -> None:
    for model in dict.fromkeys(r["model"] for r in rows):
        b, s = (args.minilm_batch, args.minilm_pad) if model == "minilm" else (args.wide_batch, args.wide_pad)
        print(f"\n{model}: batch {b} x {s}, {args.device}, {args.threads} thread(s) per rank, AdamW, "
              f"median of {args.steps} steps after {args.warmup}; MiB per rank (largest rank)")
        print(f"{'mode':>12} {'ckpt':>5} | {'weights':>8} {'grads':>8} {'optim':>8} {'act':>8} {'peak':>8} "
              f"{'rss':>8} | {'step ms':>9} {'min ms':>9} {'vs none':>7}")
        plain = {r["mode"]: r for r in rows if r["model"] == model and r["ckpt"] == "none"}
        for r in (r for r in rows if r["model"] == model):
            ratio = r["min_ms"] / plain[r["mode"]]["min_ms"] if r["mode"] in plain else float("nan")
            print(f"{r['mode']:>12} {r['ckpt']:>5} | " + " ".join(f"{r[k] / MIB:>8.1f}" for k in
                  ("weights", "grads", "optim", "act", "peak", "rss")) + f" | {r['step_ms']:>9.0f} {r['min_ms']:>9.0f} {ratio:>7.2f}")


def draw(rows: list[dict], args, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(2, len(models), figsize=(6.5 * len(models), 8), squeeze=False)
    parts = (("weights", "#4c72b0"), ("grads", "#dd8452"), ("optim", "#55a868"),
             ("act", "#c44e52", "activations, buffers, temporaries"))
    for col, model in enumerate(models):
        mine = [r for r in rows if r["model"] == model]
        labels = [f"{r['mode']}\n{'ckpt' if r['ckpt'] == 'full' else 'no ckpt'}" for r in mine]
        x = range(len(mine))
        bottom = [0.0] * len(mine)
        ax = axes[0][col]
        for key, color, *label in parts:
            vals = [max(r[key], 0) / MIB for r in mine]
            ax.bar(x, vals, bottom=bottom, color=color, label=label[0] if label else key)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_xticks(list(x), labels, fontsize=7)
        ax.set_ylabel("MiB per rank (peak of one step)")
        b, s = (args.minilm_batch, args.minilm_pad) if model == "minilm" else (args.wide_batch, args.wide_pad)
        name = "all-MiniLM-L6-v2" if model == "minilm" else "random BERT h1024 x 8 layers"
        ax.set_title(f"{name}, batch {b} x {s}", fontsize=10)
        ax.legend(fontsize=8)
        ax = axes[1][col]
        ax.bar(x, [r["min_ms"] for r in mine], color=["#8172b2" if r["ckpt"] == "none" else "#937860" for r in mine])
        ax.set_xticks(list(x), labels, fontsize=7)
        ax.set_ylabel(f"step ms (fastest of {args.steps})")
    fig.suptitle(f"Per-rank memory and step time ({args.device}, {args.threads} thread(s) per rank; "
                 f"{args.note})", fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["minilm", "wide"], choices=["minilm", "wide"])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--ckpt", nargs="+", default=["none", "full"], choices=["none", "full"])
    ap.add_argument("--minilm_dir", default=str(ROOT / "models" / "all-MiniLM-L6-v2"))
    ap.add_argument("--minilm_batch", type=int, default=16)
    ap.add_argument("--minilm_pad", type=int, default=256)
    ap.add_argument("--wide_batch", type=int, default=16)
    ap.add_argument("--wide_pad", type=int, default=256)
    ap.add_argument("--plan", default="galaxy")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--note", default="shared machine: times are noisy", help="said on the figure")
    ap.add_argument("--png", default=str(ROOT / "runs" / "bench" / "memory.png"))
    ap.add_argument("--json", default=None)
    ap.add_argument("--redraw", default=None, metavar="JSON", help="table and figure from an earlier --json")
    args = ap.parse_args()

    if args.redraw:
        rows = load_rows(args.redraw)
        print_table(rows, args)
        draw(rows, args, args.png)
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            model_dir = args.minilm_dir if model == "minilm" else write_wide_bert(os.path.join(tmp, "wide"))
            for mode in args.modes:
                for ckpt in args.ckpt:
                    rows.append(run_config(args, model, model_dir, mode, ckpt))
                    r = rows[-1]
                    print(f"  {model} {mode} ckpt={ckpt}: peak {r['peak'] / MIB:.0f} MiB, {r['step_ms']:.0f} ms",
                          flush=True)
    print_table(rows, args)
    draw(rows, args, args.png)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
