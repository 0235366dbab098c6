"""PyTorch's own tensor parallelism (DTensor parallelize_module) against Galaxy's TP preset.

World 2 over gloo, one thread per rank, all-MiniLM-L6-v2 with a 4-class head, dropout 0, the same
global batch of real sentences (bench/ddp_vs_galaxy.make_batch) on both ranks, AdamW:

  dtensor   Hugging Face BertForSequenceClassification with parallelize_module on a 1-D device
            mesh: per layer query/key/value and intermediate.dense ColwiseParallel, attention
            output.dense and output.dense RowwiseParallel (even shards: 6 heads, 768 columns per
            rank); everything else replicated. This is Megatron TP: an all-reduce after each
            row-parallel GEMM, one on each column-parallel input's gradient.
  galaxy    Galaxy's tp preset (ATT TP, MLP TP, CON None) on the same weights and even shares:
            the same algorithm through galaxy's transitions.

Not compared here: DTensor's SequenceParallel (Megatron TP+SP). Hugging Face BERT adds the
residual inside BertSelfOutput / BertOutput, next to the row-parallel GEMM, and pools the [CLS]
token from the full sequence, so a sequence-sharded residual stream needs more than a
parallelize_module plan (hand-written module changes); Galaxy's galaxy preset is measured against
the tp numbers and DDP instead (bench/overlap_paired.py, bench/ddp_vs_galaxy.py).

Per variant: median and min step time (slower rank; rounds alternate the order), and bytes one rank
sends per step in the ring convention of galaxy.profiler.comm, counted from the functional
collectives DTensor issues and from galaxy's recorder. A first check compares the two losses.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/dtensor_vs_galaxy.py [--batch_size 8] [--pad_size 128]
        [--rounds 6] [--warmup 2] [--json out.json]
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

from ddp_vs_galaxy import NUM_LABELS, make_batch  # noqa: E402
from two_ranks import add_rank_args, run_two  # noqa: E402

SENT = {"bytes": 0, "calls": 0, "on": False}


def count_functional_collectives() -> None:
    """Count what DTensor sends, in the ring convention (galaxy.distributed.comm_bytes.ring_bytes)."""
    import torch.distributed._functional_collectives as funcol
    from galaxy.distributed.comm_bytes import ring_bytes

    def wrap(name, kind, fn):
        def counted(t, *args, **kwargs):
            if SENT["on"]:
                SENT["calls"] += 1
                SENT["bytes"] += ring_bytes(kind, t.numel() if kind != "reduce_scatter" else t.numel() // 2,
                                            t.element_size(), 2)
            return fn(t, *args, **kwargs)
        setattr(funcol, name, counted)
    for name, kind in (("all_reduce", "all_reduce"), ("all_gather_single", "all_gather"),
                       ("reduce_scatter_single", "reduce_scatter")):
        wrap(name, kind, getattr(funcol, name))


def build_dtensor(model_path: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from transformers import BertForSequenceClassification
    torch.manual_seed(0)
    model = BertForSequenceClassification.from_pretrained(model_path, num_labels=NUM_LABELS, hidden_dropout_prob=0.0,
                                                          attention_probs_dropout_prob=0.0,
                                                          attn_implementation="sdpa")
    mesh = init_device_mesh("cpu", (2,))
    plan = {}
    for i, layer in enumerate(model.bert.encoder.layer):
        p = f"bert.encoder.layer.{i}"
        plan.update({f"{p}.attention.self.query": ColwiseParallel(), f"{p}.attention.self.key": ColwiseParallel(),
                     f"{p}.attention.self.value": ColwiseParallel(),
                     f"{p}.attention.output.dense": RowwiseParallel(),
                     f"{p}.intermediate.dense": ColwiseParallel(), f"{p}.output.dense": RowwiseParallel()})
        layer.attention.self.num_attention_heads //= 2        # local heads (views use head size)
        layer.attention.self.all_head_size //= 2
    parallelize_module(model, mesh, plan)
    return model


def build_galaxy(model_path: str, classifier, pad_size: int):
    from galaxy.distributed.mesh import make_mesh
    from galaxy.models.shape import read_model_shape
    from galaxy.plan import Plan, Workload
    from galaxy.runtime.runners import build_runner
    plan = Plan.preset("tp").resolve(2, Workload.of(read_model_shape(model_path), pad_size))
    runner = build_runner(model_path, plan, make_mesh(plan), num_labels=NUM_LABELS, seed=0, dropout=0.0)
    with torch.no_grad():       # the same new head as the DTensor model's
        runner.model.classifier.weight.copy_(classifier.weight)
        runner.model.classifier.bias.copy_(classifier.bias)
    return runner


def timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    elapsed = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def worker(rank: int, args, init_method: str, results) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    from galaxy.runtime import cpu_allocator
    cpu_allocator.keep_freed_memory()      # as training does (config key cpu_allocator, default "keep")
    from galaxy.distributed import waiting
    waiting.set_polling(waiting.choose_poll(args.comm_wait, "gloo", 2, os.cpu_count() or 1))
    count_functional_collectives()
    from galaxy.profiler.comm import CommRecorder
    batch = make_batch(args.model_path, args.batch_size, args.pad_size)
    dt = build_dtensor(args.model_path)
    # The DTensor model's classifier is replicated (plain); galaxy starts from the same one.
    galaxy = build_galaxy(args.model_path, dt.classifier, args.pad_size)
    # torch's default AdamW on both sides: the fused kernel refuses DTensor TP's mix of DTensor and
    # plain parameters, and this compares the parallelism, not the optimizer.
    opt_dt = torch.optim.AdamW(dt.parameters(), lr=1e-5)
    opt_g = torch.optim.AdamW(galaxy.parameters(), lr=1e-5)

    def step_dt():
        dt(**batch).loss.backward()
        opt_dt.step()
        opt_dt.zero_grad(set_to_none=True)

    def step_g():
        galaxy.step(batch)
        opt_g.step()
        opt_g.zero_grad(set_to_none=True)

    with torch.no_grad():
        loss_dt, loss_g = dt(**batch).loss.item(), galaxy(**batch)[1].item()
    SENT["on"] = True
    step_dt()
    SENT["on"] = False
    with CommRecorder() as rec:
        step_g()
    sent = {"dtensor": (SENT["bytes"], SENT["calls"]), "galaxy": (rec.stats.total().sent, rec.stats.total().calls)}
    for _ in range(args.warmup):
        step_dt(), step_g()
    times = {"dtensor": [], "galaxy": []}
    for i in range(args.rounds):
        for name, fn in ((("dtensor", step_dt), ("galaxy", step_g)) if i % 2 == 0 else
                         (("galaxy", step_g), ("dtensor", step_dt))):
            times[name].append(timed(fn))
    if rank == 0:
        results.put({"loss": {"dtensor": loss_dt, "galaxy": loss_g}, "sent": sent, "times": times})
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model_path", default=str(ROOT / "models" / "all-MiniLM-L6-v2"))
    p.add_argument("--comm_wait", default="auto", choices=("auto", "poll", "block"),
                   help="how ranks wait for collectives (config key comm_wait)")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--pad_size", type=int, default=128)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    add_rank_args(p)
    args = p.parse_args()
    out = run_two(worker, args)
    if out is None:            # a testbed rank other than 0: rank 0 reports
        return
    print(f"world 2 x {args.threads} thread, all-MiniLM-L6-v2, batch {args.batch_size} x {args.pad_size}, "
          f"{args.rounds} rounds after {args.warmup} warm-up")
    print(f"loss before training: dtensor {out['loss']['dtensor']:.6f}  galaxy tp {out['loss']['galaxy']:.6f}")
    base = statistics.median(out["times"]["dtensor"])
    for name in ("dtensor", "galaxy"):
        ts = out["times"][name]
        b, calls = out["sent"][name]
        print(f"{name:>8}: median {1e3 * statistics.median(ts):8.1f} ms  min {1e3 * min(ts):8.1f} ms  "
              f"(x{statistics.median(ts) / base:.3f})  {b / 1e6:8.2f} MB sent/rank/step in {calls} collectives")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), **out}, indent=1))


if __name__ == "__main__":
    main()
