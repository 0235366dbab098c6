"""Classification latency under Galaxy plans: one request (batch 1, one --tokens-token input) per
plan, on the ranks this process is one of (issue 31's encoder case on the testbed).

The classifier in --model_path (bench/classify_latency.py's MiniLM with a 2-class head, written
once by bench/classify_cluster.py), fp32. For each plan in --plans (presets: tp, sp, galaxy2,
megatron (= galaxy: Megatron TP+SP), even shares; "pipeline": even stages over every rank;
"serial" on one rank) and each --plan_file NAME=CONFIG.json (the plan keys of a config, e.g. the
one plan.py search --objective latency wrote): the seconds from a barrier to rank 0 holding the
logits, as `pretrain_*.py --predict` runs a batch (galaxy.runtime.runners). The plans alternate
their order every round; medians over --repeats rounds. Then, per plan, where rank 0's and every
rank's time went (bench/step_terms.py: wall, CPU, blocked = waiting on a collective or a slower
peer, kernels, Python). Rank 0 prints them; the probabilities of every plan must equal the
first plan's within 1e-5.

    flock /work/testbed.lock python -m galaxy.edge run --cluster clusters/two_equal_1g.json -- \\
        .venv/bin/python bench/classify_plans.py --model_path DIR --plans megatron --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from classify_latency import galaxy_runner, request, run_galaxy  # noqa: E402
from inference_plans import named_plans  # noqa: E402
from step_terms import all_ranks_terms  # noqa: E402
from galaxy.models.shape import read_model_shape  # noqa: E402
from testbed_args import start_plan_bench  # noqa: E402

PROBABILITY_TOL = 1e-5


def measure(runners: dict, x: dict, repeats: int) -> dict:
    """{name: {"forward_ms", "runs_ms", "probabilities"}}: rank 0's seconds from a barrier to the logits."""
    times, probs = {n: [] for n in runners}, {}
    names = list(runners)
    for name in names:                                    # warm-up
        run_galaxy(runners[name], x)
    for i in range(repeats):
        for name in (names if i % 2 == 0 else names[::-1]):
            dist.barrier()
            seconds, logits = run_galaxy(runners[name], x)
            times[name].append(seconds)
            probs[name] = torch.softmax(logits.float(), -1)[0].tolist()
    return {n: {"forward_ms": 1e3 * statistics.median(times[n]), "runs_ms": [1e3 * t for t in times[n]],
                "probabilities": probs[n]} for n in names}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--plans", nargs="*", default=[])
    p.add_argument("--plan_file", action="append", default=[], metavar="NAME=CONFIG.json")
    p.add_argument("--model_path", required=True, help="the classifier (bench/classify_latency.write_classifier)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--comm_wait", default="auto", choices=("auto", "poll", "block"))
    p.add_argument("--json")
    args = start_plan_bench(p)
    from galaxy.distributed import waiting
    polling = waiting.polling()
    layers = read_model_shape(args.model_path)["num_hidden_layers"]
    plans = named_plans(args.plans, args.plan_file, args.world, layers)
    runners = {n: galaxy_runner(args.model_path, plan, args.world, args.tokens) for n, plan in plans.items()}
    x = request(args.tokens)
    result = measure(runners, x, args.repeats)
    for name, runner in runners.items():                 # where the time went (blocking waits while measured)
        result[name]["terms"] = all_ranks_terms(lambda: run_galaxy(runner, x), waiting.set_polling)
        waiting.set_polling(polling)
    dist.barrier()
    if args.rank == 0:
        first = result[next(iter(result))]["probabilities"]
        equal = all(max(abs(a - b) for a, b in zip(r["probabilities"], first)) <= PROBABILITY_TOL
                    for r in result.values())
        print(f"classifier {args.model_path}, batch 1, {args.tokens} tokens, fp32, world {args.world} x "
              f"{args.threads} thread(s), waits {'poll' if polling else 'block'}")
        for name, r in result.items():
            terms = "; ".join(f"rank {i} wall {t['wall_ms']:.0f} cpu {t['cpu_ms']:.0f} blocked {t['blocked_ms']:.0f} "
                              f"kernels {t['kernels_ms']:.0f} python {t['python_ms']:.0f}" for i, t in enumerate(r["terms"]))
            print(f"{name:>10}: forward {r['forward_ms']:8.1f} ms   ({terms})")
        print(f"probabilities equal across plans (within {PROBABILITY_TOL:g}): {'yes' if equal else 'NO'}")
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "plans": result,
                                                   "probabilities_equal": equal}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
