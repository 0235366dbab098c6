"""Generation latency under Galaxy plans: prefill and decode of one prompt, per plan, on the ranks
this process is one of (issue 31's testbed targets).

inference_latency.py's random Llama (8 layers, hidden 1024, 16 heads, MLP 2816, vocab 32000; or
the one in --model_path), batch 1, fp32. For each plan in --plans (presets: tp, sp, galaxy,
galaxy2, megatron (= galaxy: Megatron TP+SP), each with even shares; "pipeline": even stages over
every rank; "serial" on one rank) and each --plan_file NAME=CONFIG.json (the plan keys of a
config, e.g. one plan.py search wrote): prefill = the seconds to the first new token of a --prompt-token prompt;
decode = (K - 1) / (t(K) - t(1)) tokens/s after a --decode_prompt-token prompt, EOS ignored. The
plans alternate their order every round; medians over --repeats rounds; rank 0 prints them and the
greedy tokens of every plan must equal the first plan's. A plan whose prefill runs in chunks
(prefill_chunks) also reports, per rank, where its last prefill went (prefill_parts_ms: waiting
for chunks to arrive, computing them, waiting for its last sends).

Run as the ranks of the edge testbed (galaxy.edge appends --world, --rank, --init_method):

    python -m galaxy.edge run --cluster clusters/two_equal_1g.json -- \\
        .venv/bin/python bench/inference_plans.py --plans tp sp galaxy --json out.json
    python -m galaxy.edge run --cluster ONE_DEVICE.json -- \\
        .venv/bin/python bench/inference_plans.py --plans serial --json one.json    # a cluster file of one of its devices

--plans defaults to tp sp galaxy, which load beside --plan_file's plans: to measure a plan file
alone give an empty --plans, as latency_cluster.py does (home3's nano, 1500 MiB, cannot hold
four engines of the 8 x 1024 model).

Rank 0 writes the model to a temporary folder that every rank reads (one file system), unless
--model_path names one already written (bench/latency_cluster.py writes it once for its runs).
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

from inference_latency import run_galaxy, write_model  # noqa: E402
from galaxy.distributed.mesh import make_mesh  # noqa: E402
from galaxy.inference.engine import Engine  # noqa: E402
from galaxy.models.shape import read_model_shape  # noqa: E402
from galaxy.parallel.decode_layout import TOKEN_SUM_NAMES, default_token_sum  # noqa: E402
from galaxy.plan import Plan, Workload, even_split  # noqa: E402
from galaxy.runtime.assemble import build_model  # noqa: E402
from galaxy.runtime.runners import stage_of  # noqa: E402
from testbed_args import start_plan_bench  # noqa: E402


def named_plans(names: list[str], files: list[str], world: int, layers: int) -> dict[str, Plan]:
    """{name: unresolved Plan} of --plans and --plan_file NAME=CONFIG.json (its plan keys)."""
    plans = {}
    for name in names:
        if name == "serial":
            plans[name] = Plan()
        elif name == "pipeline":        # as-equal stages, one per rank; one request is one micro-batch
            plans[name] = Plan(pp=world, stages=tuple(even_split(layers, world)), schedule="gpipe")
        else:
            plans[name] = Plan.preset("galaxy" if name == "megatron" else name)
    for entry in files:
        name, _, path = entry.partition("=")
        plans[name] = Plan.from_keys(json.loads(Path(path).read_text()))
    return plans


def model_config(path: str) -> dict:
    """The model folder's config.json (its shape, vocab_size, eos_token_id)."""
    return {**json.loads((Path(path) / "config.json").read_text()), **read_model_shape(path)}


def engine_for(path: str, plan: Plan, world: int, pad: int, token_sum: str) -> Engine:
    from transformers import AutoTokenizer
    shape = model_config(path)
    plan = plan.resolve(world, Workload.of(shape, pad))
    mesh = make_mesh(plan)
    model = build_model(path, plan, mesh.galaxy, stage=stage_of(plan, mesh))
    return Engine(model, plan, mesh, AutoTokenizer.from_pretrained(path), eos_ids=[shape["eos_token_id"]],
                  token_sum=token_sum)


def measure(engines: dict, args, vocab: int) -> dict:
    draw = torch.Generator().manual_seed(1)
    long_ids = [1] + torch.randint(3, vocab, (args.prompt - 1,), generator=draw).tolist()
    short = long_ids[:args.decode_prompt]
    times = {n: {"prefill": [], "one": [], "many": []} for n in engines}
    tokens, parts = {}, {}
    names = list(engines)
    for name in names:                                    # warm-up
        run_galaxy(engines[name], short, 2)
    for i in range(args.repeats):
        for name in (names if i % 2 == 0 else names[::-1]):
            for what, ids, new in (("prefill", long_ids, 1), ("one", short, 1), ("many", short, args.new)):
                dist.barrier()
                seconds, got = run_galaxy(engines[name], ids, new)
                times[name][what].append(seconds)
                if what == "prefill" and engines[name].prefill_parts is not None:   # a chunked prefill's parts
                    parts[name] = {k: round(v * 1e3, 1) for k, v in engines[name].prefill_parts.items()}
                if what == "many":
                    tokens[name] = got
    out = {}
    for name, t in times.items():
        one, many = statistics.median(t["one"]), statistics.median(t["many"])
        out[name] = {"prefill_ms": 1e3 * statistics.median(t["prefill"]),
                     "decode_tokens_per_s": (args.new - 1) / max(many - one, 1e-9), "tokens": tokens[name]}
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, parts.get(name))        # each rank's last chunked prefill, ms
        if any(every):
            out[name]["prefill_parts_ms"] = every
    first = tokens[names[0]]
    return {"plans": out, "tokens_equal": all(tokens[n] == first for n in names)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--plans", nargs="*", default=["tp", "sp", "galaxy"])
    p.add_argument("--plan_file", action="append", default=[], metavar="NAME=CONFIG.json",
                   help="also measure the plan keys of this config under NAME (repeatable)")
    p.add_argument("--model_path", help="a bench Llama already written (every rank reads it); default: rank 0 "
                                        "writes inference_latency.py's to a temporary folder")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--decode_prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--comm_wait", default="auto", choices=("auto", "poll", "block"),
                   help="how ranks wait for collectives (config key comm_wait; auto polls where each rank has a core)")
    p.add_argument("--token_sum", nargs="+", default=[default_token_sum("cpu")], choices=TOKEN_SUM_NAMES,
                   help="how a decode step sums a TP sub-block's one-token output (galaxy.parallel.decode_layout); "
                        "several: each plan once with each, named PLAN/SUM, alternating in the same rounds")
    p.add_argument("--json")
    args = start_plan_bench(p)
    from galaxy.distributed import waiting
    print(f"rank {args.rank}: waits {'poll' if waiting.polling() else 'block'}", flush=True)
    with tempfile.TemporaryDirectory() as own:
        path = [args.model_path or own]
        if args.rank == 0 and not args.model_path:
            write_model(own)
        dist.broadcast_object_list(path, src=0)          # every rank reads rank 0's copy
        shape = model_config(path[0])
        plans = named_plans(args.plans, args.plan_file, args.world, shape["num_hidden_layers"])
        sums = args.token_sum
        engines = {name if len(sums) == 1 else f"{name}/{summed}":
                   engine_for(path[0], plan, args.world, args.prompt, summed)
                   for name, plan in plans.items() for summed in sums}
        result = measure(engines, args, shape["vocab_size"])
        dist.barrier()                                   # rank 0's folder outlives every reader
    if args.rank == 0:
        print(f"random Llama {shape['num_hidden_layers']} x {shape['hidden_size']}, batch 1, fp32, world {args.world} "
              f"x {args.threads} thread(s), prompt {args.prompt}, decode after {args.decode_prompt}")
        for name, r in result["plans"].items():
            print(f"{name:>16}: prefill {r['prefill_ms']:8.1f} ms   decode {r['decode_tokens_per_s']:6.2f} tokens/s")
        print(f"greedy tokens equal across plans: {'yes' if result['tokens_equal'] else 'NO'}")
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), **result}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
