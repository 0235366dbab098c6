"""PyTorch's own tensor parallelism (DTensor parallelize_module: Megatron TP and TP+SP) against
Galaxy's presets, full fine-tuning.

World 2 over gloo, one thread per rank, all-MiniLM-L6-v2 with a 4-class head, dropout 0, the same
global batch of real sentences (bench/ddp_vs_galaxy.make_batch) on both ranks, AdamW (torch's
default on every variant: the fused kernel refuses DTensor TP's mix of DTensor and plain
parameters, and this compares the parallelism, not the optimizer). Variants (--variants):

  dtensor-tp    Hugging Face BertForSequenceClassification under torch's Megatron TP plan
                (bench/dtensor_bert.py): Colwise q/k/v and intermediate.dense, Rowwise outputs;
                an all-reduce after each row-parallel GEMM and on each column-parallel input's
                gradient (q, k and v: three per attention)
  dtensor-tpsp  the same with Megatron sequence parallelism (bench/dtensor_bert.py): residual
                stream, LayerNorms and dropout on (b, s/2, h) sequence shards, all-gather into
                attention and MLP, reduce-scatter out of them, the pooler's input gathered back
  galaxy-tp     Galaxy's tp preset (ATT TP, MLP TP, CON None), even shares
  galaxy        the Galaxy preset (ATT TP, CON SP, MLP TP), even shares: TP+SP in Galaxy's
                transitions; after the last layer it gathers the [CLS] row only
  galaxy-s2     the same with batch_streams 2 (each half of the batch's communication overlaps
                the other half's compute; bench/results/overlap_paired.md)

Before timing, each DTensor variant is checked against the serial Hugging Face model (a fresh
copy of both in float64, one SGD step of lr 0.1 on the bench's batch): the worst relative error
of the loss, the logits, every gradient, the LayerNorm weights' gradients alone (under SP: the sum over the
sequence shards) and every weight after the step, each against 1e-5 (max |a - b| over
max(max |b|, 1e-3 x the model's largest value), as the test suite's parity takes it). Float64,
because in float32 at batch 8 x 128 even plain TP's LayerNorm bias gradients differ from the serial
ones by 1.6e-5 (the all-reduce sums the row-parallel halves in another order than one GEMM does);
in float64 that rounding is ~1e-14 and a missing or doubled sum over shards shows as ~1. Galaxy's
presets are held to the same serial model by the test suite; here their loss before training
is printed beside the DTensor ones (the same new head on every variant).

Per variant: median and min step time (forward, backward, AdamW, zero_grad; the slower rank's;
rounds alternate the order), and per rank the bytes it sends per step in the ring convention of
galaxy.profiler.comm (all-gather / reduce-scatter of E bytes a rank over 2 ranks: E; all-reduce
of E bytes: E), and its collectives, counted from the functional collectives DTensor issues and
from Galaxy's recorder. --terms adds one step's breakdown per variant and rank (bench/step_terms.py:
kernels, Python and dispatch, time blocked in communication and waits on the peer).

    HF_HUB_OFFLINE=1 .venv/bin/python bench/dtensor_vs_galaxy.py [--variants dtensor-tp dtensor-tpsp
        galaxy-tp galaxy galaxy-s2] [--batch 8] [--pad_size 128] [--rounds 6] [--warmup 2] [--terms]
        [--json out.json]
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
from dtensor_bert import build_dtensor_bert, check_against_serial, load_bert  # noqa: E402
from step_terms import print_terms  # noqa: E402
from two_ranks import add_rank_args, run_two  # noqa: E402

# variant: ("dtensor", sequence parallel) or ("galaxy", preset, batch_streams)
VARIANTS = {"dtensor-tp": ("dtensor", False), "dtensor-tpsp": ("dtensor", True),
            "galaxy-tp": ("galaxy", "tp", 1), "galaxy": ("galaxy", "galaxy", 1), "galaxy-s2": ("galaxy", "galaxy", 2)}
TOLERANCE = 1e-5
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


def build_galaxy(model_path: str, preset: str, batch_streams: int, classifier, pad_size: int):
    from galaxy.distributed.mesh import make_mesh
    from galaxy.models.shape import read_model_shape
    from galaxy.plan import Plan, Workload
    from galaxy.runtime.runners import build_runner
    plan = Plan.preset(preset, batch_streams=batch_streams)
    plan = plan.resolve(2, Workload.of(read_model_shape(model_path), pad_size))
    runner = build_runner(model_path, plan, make_mesh(plan), num_labels=NUM_LABELS, seed=0, dropout=0.0)
    with torch.no_grad():       # the same new head as the DTensor models'
        runner.model.classifier.weight.copy_(classifier.weight)
        runner.model.classifier.bias.copy_(classifier.bias)
    return runner


class Trainer:
    """One variant's model and AdamW: step(), loss before training, bytes and collectives per step."""

    def __init__(self, name: str, args, classifier):
        spec = VARIANTS[name]
        self.dtensor = spec[0] == "dtensor"
        if self.dtensor:
            self.model = build_dtensor_bert(args.model_path, spec[1])
        else:
            self.model = build_galaxy(args.model_path, spec[1], spec[2], classifier, args.pad_size)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5)

    def step(self, batch) -> None:
        if self.dtensor:
            self.model(**batch).loss.backward()
        else:
            self.model.step(batch)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def loss(self, batch) -> float:
        with torch.no_grad():
            return (self.model(**batch).loss if self.dtensor else self.model(**batch)[1]).item()

    def sent(self, batch) -> tuple[int, int]:
        """(bytes this rank sends, collectives it takes part in) in one step."""
        if self.dtensor:
            SENT.update(bytes=0, calls=0, on=True)
            self.step(batch)
            SENT["on"] = False
            return SENT["bytes"], SENT["calls"]
        from galaxy.profiler.comm import CommRecorder
        with CommRecorder() as rec:
            self.step(batch)
        return rec.stats.total().sent, rec.stats.total().calls


def check_dtensor(args, batch) -> dict:
    """check_against_serial for each DTensor variant asked for (fresh models, float64: see the
    module docstring)."""
    f64 = torch.float64
    return {name: check_against_serial(build_dtensor_bert(args.model_path, VARIANTS[name][1], f64),
                                       load_bert(args.model_path, f64), batch)
            for name in args.variants if VARIANTS[name][0] == "dtensor"}


def timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    elapsed = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def per_rank(value) -> list:
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return every


def measure(args, trainers: dict, batch) -> dict:
    """Losses before training, per-rank bytes, paired step times and (--terms) step terms."""
    from galaxy.distributed import waiting
    out = {"loss": {n: t.loss(batch) for n, t in trainers.items()},
           "sent": {n: per_rank(t.sent(batch)) for n, t in trainers.items()}}
    poll = waiting.polling()
    for _ in range(args.warmup):
        for t in trainers.values():
            t.step(batch)
    order = list(trainers)
    out["times"] = {n: [] for n in order}
    for i in range(args.rounds):
        for name in order if i % 2 == 0 else order[::-1]:
            out["times"][name].append(timed(lambda: trainers[name].step(batch)))
    if args.terms:
        from step_terms import all_ranks_terms
        out["terms"] = {n: all_ranks_terms(lambda: t.step(batch), waiting.set_polling) for n, t in trainers.items()}
        waiting.set_polling(poll)
    return out


def worker(rank: int, args, init_method: str, results) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    from galaxy.runtime import cpu_allocator
    cpu_allocator.keep_freed_memory()      # as training does (config key cpu_allocator, default "keep")
    from galaxy.distributed import waiting
    waiting.set_polling(waiting.choose_poll(args.comm_wait, "gloo", 2, os.cpu_count() or 1))
    count_functional_collectives()
    batch = make_batch(args.model_path, args.batch, args.pad_size)
    checks = check_dtensor(args, batch)
    classifier = load_bert(args.model_path).classifier      # every variant's head (seed 0)
    trainers = {name: Trainer(name, args, classifier) for name in args.variants}
    out = measure(args, trainers, batch)
    if rank == 0:
        results.put({"check": checks, **out})
    dist.barrier()
    dist.destroy_process_group()


def print_check(checks: dict) -> bool:
    """The DTensor variants' check against the serial model; True when every error is in tolerance."""
    ok = True
    for name, c in checks.items():
        worst = {k: v for k, v in c.items() if k != "tensors"}
        fine = all(err <= TOLERANCE for err, _ in worst.values())
        ok &= fine
        print(f"check {name} against serial HF ({c['tensors']} gradients, one SGD step): "
              + "  ".join(f"{k} {err:.1e}" for k, (err, _) in worst.items())
              + f"  worst at {max(worst.values())[1]}: {'ok' if fine else 'FAILS'} (tolerance {TOLERANCE:g})")
    return ok


def print_times(out: dict) -> None:
    names = list(out["times"])
    base = statistics.median(out["times"][names[0]])
    print("loss before training: " + "  ".join(f"{n} {loss:.6f}" for n, loss in out["loss"].items()))
    for name in names:
        ts = out["times"][name]
        sent = "  ".join(f"rank {r}: {b / 1e6:.2f} MB in {calls}" for r, (b, calls) in enumerate(out["sent"][name]))
        print(f"{name:>12}: median {1e3 * statistics.median(ts):8.1f} ms  min {1e3 * min(ts):8.1f} ms  "
              f"(x{statistics.median(ts) / base:.3f} of {names[0]})  sent/step {sent} collectives")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model_path", default=str(ROOT / "models" / "all-MiniLM-L6-v2"))
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                   help="the first is the baseline of the x column")
    p.add_argument("--comm_wait", default="auto", choices=("auto", "poll", "block"),
                   help="how ranks wait for collectives (config key comm_wait)")
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences), the same on both ranks")
    p.add_argument("--pad_size", type=int, default=128)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--terms", action="store_true", help="one more step per variant, broken into its terms")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    add_rank_args(p)
    args = p.parse_args()
    out = run_two(worker, args)
    if out is None:            # a testbed rank other than 0: rank 0 reports
        return
    print(f"world 2 x {args.threads} thread, all-MiniLM-L6-v2, batch {args.batch} x {args.pad_size}, "
          f"{args.rounds} rounds after {args.warmup} warm-up")
    ok = print_check(out["check"])
    print_times(out)
    if args.terms:
        print_terms(out["terms"])
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), **out}, indent=1))
    if not ok:
        raise SystemExit("a DTensor variant does not train like the serial model: its times do not count")


if __name__ == "__main__":
    main()
