"""Generation latency under Galaxy plans: prefill and decode of one prompt, per plan, on the ranks
this process is one of (issue 31's testbed targets).

inference_latency.py's random Llama (8 layers, hidden 1024, 16 heads, MLP 2816, vocab 32000),
batch 1, fp32. For each plan in --plans (presets: tp, sp, galaxy, megatron...; even shares; or
"serial" on one rank): prefill = the seconds to the first new token of a --prompt-token prompt;
decode = (K - 1) / (t(K) - t(1)) tokens/s after a --decode_prompt-token prompt, EOS ignored. The
plans alternate their order every round; medians over --repeats rounds; rank 0 prints them and the
greedy tokens of every plan must equal the first plan's.

Run as the ranks of the edge testbed (galaxy.edge appends --world, --rank, --init_method):

    python -m galaxy.edge run --cluster clusters/two_equal_1g.json -- \\
        .venv/bin/python bench/inference_plans.py --plans tp sp galaxy --json out.json
    python -m galaxy.edge run --cluster ONE_DEVICE.json -- \\
        .venv/bin/python bench/inference_plans.py --plans serial --json one.json    # a cluster file of one of its devices

Rank 0 writes the model to a temporary folder that every rank reads (one file system).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from inference_latency import SHAPE, run_galaxy, write_model  # noqa: E402
from galaxy.distributed.mesh import make_mesh  # noqa: E402
from galaxy.distributed.transitions import TOKEN_SUMS  # noqa: E402
from galaxy.inference.engine import Engine  # noqa: E402
from galaxy.parallel.decode_layout import DEFAULT_TOKEN_SUM  # noqa: E402
from galaxy.plan import Plan, Workload  # noqa: E402
from galaxy.runtime.assemble import build_model  # noqa: E402


def engine_for(path: str, name: str, world: int, pad: int, token_sum: str) -> Engine:
    from transformers import AutoTokenizer
    plan = Plan() if name == "serial" else Plan.preset(name)
    plan = plan.resolve(world, Workload.of(SHAPE, pad))
    mesh = make_mesh(plan)
    model = build_model(path, plan, mesh.galaxy)
    return Engine(model, plan, mesh, AutoTokenizer.from_pretrained(path), eos_ids=[SHAPE["eos_token_id"]],
                  token_sum=token_sum)


def measure(engines: dict, args) -> dict:
    draw = torch.Generator().manual_seed(1)
    long_ids = [1] + torch.randint(3, SHAPE["vocab_size"], (args.prompt - 1,), generator=draw).tolist()
    short = long_ids[:args.decode_prompt]
    times = {n: {"prefill": [], "one": [], "many": []} for n in engines}
    tokens = {}
    names = list(engines)
    for name in names:                                    # warm-up
        run_galaxy(engines[name], short, 2)
    for i in range(args.repeats):
        for name in (names if i % 2 == 0 else names[::-1]):
            for what, ids, new in (("prefill", long_ids, 1), ("one", short, 1), ("many", short, args.new)):
                dist.barrier()
                seconds, got = run_galaxy(engines[name], ids, new)
                times[name][what].append(seconds)
                if what == "many":
                    tokens[name] = got
    out = {}
    for name, t in times.items():
        one, many = statistics.median(t["one"]), statistics.median(t["many"])
        out[name] = {"prefill_ms": 1e3 * statistics.median(t["prefill"]),
                     "decode_tokens_per_s": (args.new - 1) / max(many - one, 1e-9)}
    first = tokens[names[0]]
    return {"plans": out, "tokens_equal": all(tokens[n] == first for n in names)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--plans", nargs="+", default=["tp", "sp", "galaxy"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--decode_prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--comm_wait", default="auto", choices=("auto", "poll", "block"),
                   help="how ranks wait for collectives (config key comm_wait; auto polls where each rank has a core)")
    p.add_argument("--token_sum", default=DEFAULT_TOKEN_SUM, choices=sorted(TOKEN_SUMS),
                   help="how a decode step sums a TP sub-block's one-token output (galaxy.parallel.decode_layout)")
    p.add_argument("--json")
    p.add_argument("--world", type=int, default=1, help="set by galaxy.edge run")
    p.add_argument("--rank", type=int, default=0, help="set by galaxy.edge run")
    p.add_argument("--init_method", default=None, help="set by galaxy.edge run")
    args = p.parse_args()
    if "serial" in args.plans and args.world != 1:
        p.error("--plans serial runs on one rank (a one-device cluster)")
    torch.set_num_threads(args.threads)
    if args.init_method:
        from galaxy.distributed.interface import bind_to_rendezvous
        bind_to_rendezvous(args.init_method)
    init = args.init_method or f"file://{tempfile.mkstemp()[1]}"
    dist.init_process_group("gloo", init_method=init, world_size=args.world, rank=args.rank)
    from galaxy.distributed import waiting       # as generate.py's launch does: a sleeping waiter wakes late
    from galaxy.launch import ranks_and_cores_on_this_host
    waiting.set_polling(waiting.choose_poll(args.comm_wait, "gloo", *ranks_and_cores_on_this_host()))
    print(f"rank {args.rank}: waits {'poll' if waiting.polling() else 'block'}", flush=True)
    with tempfile.TemporaryDirectory() as own:
        path = [own]
        if args.rank == 0:
            write_model(own)
        dist.broadcast_object_list(path, src=0)          # every rank reads rank 0's copy
        engines = {name: engine_for(path[0], name, args.world, args.prompt, args.token_sum) for name in args.plans}
        result = measure(engines, args)
        dist.barrier()                                   # rank 0's folder outlives every reader
    if args.rank == 0:
        print(f"random Llama 8 x 1024, batch 1, fp32, world {args.world} x {args.threads} thread(s), "
              f"prompt {args.prompt}, decode after {args.decode_prompt}")
        for name, r in result["plans"].items():
            print(f"{name:>8}: prefill {r['prefill_ms']:8.1f} ms   decode {r['decode_tokens_per_s']:6.2f} tokens/s")
        print(f"greedy tokens equal across plans: {'yes' if result['tokens_equal'] else 'NO'}")
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), **result}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
