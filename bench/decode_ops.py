"""What one decode step does besides its products: operators per token, and their self-time shares.

torch.profiler over KV-cached generation of the bench Llama (inference_latency.py's shape, or a
smaller one with --layers / --hidden), batch 1, fp32: galaxy's engine serially and, at world 2
over gloo on loopback, under the plans in --plans (tp, sp, galaxy: even presets); serially also
Hugging Face's `generate` with its cache. One token's share is the difference between a run of
1 + --new tokens and a run of 1 (the same prompt), divided by --new, so the prompt's prefill
cancels. Per run (rank 0 of a plan) it prints:

  top-level operators per token   the aten calls Python makes (each pays the dispatcher), and
                                  every operator counted with its children
  self time shares                matrix products, collectives (and gloo's waits), the rest;
                                  and the part of the step's wall time outside any operator
                                  (Python), all under the profiler (counts and shares are
                                  meaningful on a loaded host, absolute times are not)
  the most frequent operators     name, calls per token, self-time share

Also (--latency): a micro-bench of the primitives a one-token all-reduce could be made of, on two
ranks over loopback, for --bytes: all_reduce, all_gather into one tensor then a sum, all_to_all
then a sum, and a paired isend / irecv exchange then an add; median and min microseconds of 300
calls (waits polled where comm_wait polls, but the exchange's: gloo's send and receive works
report completion only inside wait()).

    HF_HUB_OFFLINE=1 .venv/bin/python bench/decode_ops.py [--plans serial hf tp sp galaxy]
        [--new 16] [--layers 8] [--hidden 1024] [--token_sum all_to_all] [--latency] [--json out.json]

A folder given as --model_dir is written once and reused. To count another revision the same
way, run this file from an export of it (`git archive REV | tar -x -C DIR`): it imports the galaxy
beside it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

PRODUCTS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_dot_product", "aten::baddbmm")
COLLECTIVE = ("gloo:", "c10d::", "record_param_comms", "nccl:")


def shape_of(args) -> dict:
    from inference_latency import SHAPE
    heads = max(1, args.hidden // 64)
    inter = SHAPE["intermediate_size"] * args.hidden // SHAPE["hidden_size"]
    return {**SHAPE, "num_hidden_layers": args.layers, "hidden_size": args.hidden, "num_attention_heads": heads,
            "num_key_value_heads": heads, "intermediate_size": inter}


def write_model(path: str, shape: dict) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM
    from galaxy.assets.tiny_llama import default_tokenizer
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**shape)).save_pretrained(path)
    default_tokenizer().save_pretrained(path)


def galaxy_runner(path: str, name: str, world: int, shape: dict, pad: int, token_sum=None):
    from transformers import AutoTokenizer
    from galaxy.distributed.mesh import make_mesh
    from galaxy.inference.engine import Engine
    from galaxy.inference.requests import Request
    from galaxy.plan import Plan, Workload
    from galaxy.runtime.assemble import build_model
    plan = (Plan() if name == "serial" else Plan.preset(name)).resolve(world, Workload.of(shape, pad))
    mesh = make_mesh(plan)
    chosen = {"token_sum": token_sum} if token_sum else {}          # none: the revision's default
    engine = Engine(build_model(path, plan, mesh.galaxy), plan, mesh, AutoTokenizer.from_pretrained(path),
                    eos_ids=[shape["eos_token_id"]], **chosen)

    def run(ids, new):
        return engine.generate([Request("", tuple(ids), new, ignore_eos=True)])[0].tokens
    return run


def hf_runner(path: str):
    from transformers import LlamaForCausalLM
    hf = LlamaForCausalLM.from_pretrained(path).eval()

    @torch.no_grad()
    def run(ids, new):
        x = torch.tensor([ids])
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, pad_token_id=0)
        return out[0, len(ids):].tolist()
    return run


def profiled(run, ids, new) -> dict:
    """Operator calls and self microseconds of one run, and its wall microseconds."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        tokens = run(ids, new)
        wall = (time.perf_counter() - start) * 1e6
    calls, self_us, top = Counter(), Counter(), Counter()
    for e in prof.events():
        calls[e.name] += 1
        self_us[e.name] += e.self_cpu_time_total
        if e.cpu_parent is None:
            top[e.name] += 1
    return {"calls": calls, "self_us": self_us, "top": top, "wall_us": wall, "tokens": tokens}


def per_token(run, ids, new: int) -> dict:
    """What one decode token costs: (run of 1 + new tokens) - (run of 1), divided by new."""
    run(ids, 3)                                                       # warm-up
    one, many = profiled(run, ids, 1), profiled(run, ids, 1 + new)
    diff = {k: {n: (many[k][n] - one[k].get(n, 0)) / new for n in many[k]} for k in ("calls", "self_us", "top")}
    kinds = Counter()
    for n, us in diff["self_us"].items():
        kinds["products" if n.startswith(PRODUCTS) else "collectives" if n.startswith(COLLECTIVE) else "other ops"] += us
    wall = (many["wall_us"] - one["wall_us"]) / new
    kinds["outside operators"] = max(wall - sum(diff["self_us"].values()), 0.0)
    return {"top_level_ops": sum(v for n, v in diff["top"].items() if n.startswith("aten::")),
            "all_ops": sum(diff["calls"].values()), "wall_us": wall,
            "shares": {k: v / max(sum(kinds.values()), 1e-9) for k, v in kinds.items()},
            "ops": {n: [diff["calls"][n], diff["self_us"][n]] for n in diff["calls"] if diff["calls"][n] > 0},
            "tokens": many["tokens"]}


def report(name: str, r: dict, layers: int) -> None:
    total_self = sum(us for _, us in r["ops"].values()) or 1.0
    print(f"\n== {name}: {r['top_level_ops']:.1f} top-level aten calls a token ({r['top_level_ops'] / layers:.1f} a layer), "
          f"{r['all_ops']:.1f} operators in all; {r['wall_us'] / 1e3:.1f} ms a token under the profiler")
    print("   shares of the step: " + ", ".join(f"{k} {v:.1%}" for k, v in r["shares"].items()))
    for n, (calls, us) in sorted(r["ops"].items(), key=lambda kv: -kv[1][0])[:14]:
        print(f"   {n:<44} {calls:6.1f} calls   {us / total_self:6.1%} of operator self time")


def rank_main(rank: int, world: int, init: str, path: str, plans: list, args, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, world_size=world, rank=rank)
    from galaxy.distributed import waiting
    waiting.set_polling(waiting.choose_poll(args.comm_wait, "gloo", world, len(waiting.usable_core_ids())))
    shape = json.loads((Path(path) / "config.json").read_text())
    ids = [1] + list(range(3, 3 + args.prompt - 1))
    for name in plans:
        run = hf_runner(path) if name == "hf" else galaxy_runner(path, name, world, shape, args.prompt, args.token_sum)
        result = per_token(run, ids, args.new)
        if rank == 0:
            out[name] = result
            report(name, result, shape["num_hidden_layers"])
    if world > 1 and args.latency:
        out_lat = latency_bench(args.bytes)
        if rank == 0:
            out["latency"] = out_lat
    dist.destroy_process_group()


def latency_bench(nbytes: int, calls: int = 300) -> dict:
    """Microseconds of the one-token reduction primitives between the ranks (median, min)."""
    from galaxy.distributed import waiting
    x = torch.randn(nbytes // 4)
    world, rank = dist.get_world_size(), dist.get_rank()
    flat = torch.empty(world * x.numel())
    recv = torch.empty_like(x)

    def all_reduce():
        waiting.wait(dist.all_reduce(x.clone(), async_op=True))

    def gather_sum():
        waiting.wait(dist.all_gather_into_tensor(flat, x, async_op=True))
        flat.view(world, -1).sum(0)

    sent, got = torch.empty(world, x.numel()), torch.empty(world, x.numel())

    def all_to_all_sum():
        sent.copy_(x.expand(world, -1))
        waiting.wait(dist.all_to_all_single(got, sent, async_op=True))
        got.sum(0)

    def exchange():
        peer = 1 - rank
        works = [dist.isend(x, peer), dist.irecv(recv, peer)]
        for w in works:
            w.wait()         # gloo's send and receive works report completion only inside wait()
        x + recv
    tried = {"all_reduce": all_reduce, "all_gather + sum": gather_sum, "all_to_all + sum": all_to_all_sum}
    if world == 2:
        tried["isend/irecv exchange + add"] = exchange
    result = {}
    for name, fn in tried.items():
        times = []
        for _ in range(calls):
            dist.barrier()
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e6)
        result[name] = (statistics.median(times), min(times))
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--plans", nargs="+", default=["serial", "hf", "tp", "sp", "galaxy"])
    p.add_argument("--new", type=int, default=16)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--model_dir", help="a folder to write the model to once and reuse")
    p.add_argument("--comm_wait", default="auto", choices=("auto", "poll", "block"))
    p.add_argument("--latency", action="store_true", help="also the one-token reduction micro-bench")
    p.add_argument("--bytes", type=int, default=4096)
    p.add_argument("--token_sum", help="all_to_all, exchange or all_reduce (galaxy.parallel.decode_layout)")
    p.add_argument("--json")
    args = p.parse_args()
    path = args.model_dir or tempfile.mkdtemp()
    if not (Path(path) / "config.json").exists():
        write_model(path, shape_of(args))
    serial = [n for n in args.plans if n in ("serial", "hf")]
    parallel = [n for n in args.plans if n not in ("serial", "hf")]
    results = mp.Manager().dict()
    for world, plans in ((1, serial), (2, parallel)):
        if plans or (world == 2 and args.latency):
            init = f"file://{tempfile.mkstemp()[1]}"
            mp.spawn(rank_main, (world, init, path, plans, args, results), nprocs=world)
    tokens = {n: results[n]["tokens"] for n in args.plans}
    print("\ngreedy tokens equal across runs: " + ("yes" if len({tuple(t) for t in tokens.values()}) == 1 else "NO"))
    if "latency" in results:
        print(f"one-token reduction of {args.bytes} bytes at world 2 (us, median / min of 300):")
        for n, (med, low) in results["latency"].items():
            print(f"   {n:<30} {med:8.1f} {low:8.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(results), indent=1, default=str))


if __name__ == "__main__":
    main()
