"""The latency planner on an emulated cluster: `plan.py search --objective latency`'s plan and its
predictions against measured generation, beside the even plans users write and the fastest device alone.

On the edge testbed (`python -m galaxy.edge run --cluster FILE`: one rank per device, its CPU
share, memory limit and shaped link), with inference_latency.py's random Llama (8 x 1024, fp32;
written once to --out/model, which every rank reads), batch 1:

  1. plan.py profile-model (host) and profile-devices (inside the testbed) on a base config of
     that model (batch 1, pad_size = --prompt), then plan.py search --objective latency
     --prompt_tokens --prompt --new_tokens --new --json
  2. bench/inference_plans.py measures, each plan in its own launch (a device killed for memory
     loses only that plan, and is reported so): the searched plan (--plan_file), the even plans a
     user writes (megatron = Megatron TP+SP (the galaxy preset, even), tp, sp, galaxy2 (TP SP SP),
     an even pipeline) and, on a cluster of the fastest device alone (the most cpus), the serial
     model; --rounds rounds, alternating their order, each plan's quickest prefill counted
  3. per plan: predicted and measured prefill (a --prompt-token prompt) and decode tokens/s (after
     --decode_prompt tokens, as inference_plans.py measures it; predicted for that request), their
     ratios, each device's peak memory (the testbed's cgroup figure) against the predicted MiB
     with the KV cache; the searched plan's speed-ups against the device alone and each even
     plan; results.json and latency.png in --out.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/latency_cluster.py --cluster clusters/home3.json
        [--prompt 512] [--decode_prompt 32] [--new 32] [--repeats 3] [--rounds 2]
        [--profile_statistic mean|median|min] [--out runs/bench/latency_cluster_home3]

needs root (the testbed). Without --cluster it runs the same steps over loopback with --world
ranks (a check of its code paths, e.g. --world 3 --layers 2 --hidden 128 --prompt 48 --new 8).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from planning_runs import ROOT, env, profile, run_ranks, use_cluster
from plan_cluster import launch_on, one_device_cluster, slug
from inference_latency import SHAPE, write_model

PRESETS = ["megatron", "tp", "sp", "galaxy2", "pipeline"]     # inference_plans.py's names, even over every rank


def bench_shape(layers: int, hidden: int) -> dict:
    """SHAPE, or a smaller Llama of its proportions (heads of 64, MLP 2.75 x hidden) for checks."""
    if (layers, hidden) == (SHAPE["num_hidden_layers"], SHAPE["hidden_size"]):
        return SHAPE
    heads = max(1, hidden // 64)
    return {**SHAPE, "num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
            "num_key_value_heads": heads, "intermediate_size": 64 * round(hidden * 2.75 / 64)}


def write_inputs(out: Path, shape: dict, prompt: int) -> tuple[str, str]:
    """The bench Llama (written once; kept while its shape is the same) and its base config:
    batch 1, pad_size = the prompt (a token-splitting plan pads every prompt to it)."""
    model = out / "model"
    written = model / "config.json"
    if not written.exists() or any(json.loads(written.read_text()).get(k) != v for k, v in shape.items()
                                   if k != "tie_word_embeddings"):
        write_model(str(model), shape)
    base = {"model_path": str(model), "pad_size": prompt, "batch_size": 1, "learning_rate": 1e-4, "max_steps": 1,
            "seed": 42, "timeout_s": 120}
    path = out / "base.json"
    path.write_text(json.dumps(base, indent=1))
    return str(model), str(path)


def search(out: Path, base: str, model_json: str, devices_json: str, args) -> str:
    """plan.py search --objective latency; the written config's path (its plans: plans.json)."""
    searched = out / "searched.json"
    done = subprocess.run([sys.executable, "plan.py", "search", "--config_file", base, "--devices", devices_json,
                           "--model", model_json, "--objective", "latency", "--prompt_tokens", str(args.prompt),
                           "--new_tokens", str(args.new), "--out", str(searched), "--json", str(out / "plans.json"),
                           "--top", "20"], cwd=ROOT, env=env(), capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"plan.py search --objective latency failed:\n{done.stdout}{done.stderr}")
    lines = done.stdout.splitlines()
    header = next((i for i, line in enumerate(lines) if line.startswith(" #  total")), 5)
    print("\n".join(lines[:header + 4]), flush=True)         # the subsets searched, the best 3 plans
    return str(searched)


def predictor(model_json: str, devices_json: str, model_path: str, args, only: tuple | None = None):
    """Plan -> the latency cost model's figures for the request measured: the prefill of --prompt
    tokens (with --new after it: the search's request; its memory), the decode step after
    --decode_prompt tokens (inference_plans.py's decode request); {} for a plan that cannot be
    formed (only: those devices' ranks, the link among them as the search sees it)."""
    from galaxy.models.shape import read_model_shape
    from galaxy.plan import PlanError, Workload
    from galaxy.planner.latency_cost import LatencyCostModel
    from galaxy.planner.latency_devices import sub_link
    from galaxy.planner.profiles import load_devices, read_json
    model, (devices, link) = read_json(model_json), load_devices(devices_json)
    if only is not None:
        devices, link = [devices[r] for r in only], sub_link(link, tuple(only), len(devices))
    prefill = LatencyCostModel(model, devices, link, prompt_tokens=args.prompt, new_tokens=args.new)
    decode = LatencyCostModel(model, devices, link, prompt_tokens=args.decode_prompt, new_tokens=args.new)
    work = Workload.of(read_model_shape(model_path), args.prompt)

    def predict(plan) -> dict:
        try:
            resolved = plan.resolve(len(devices), work)
        except PlanError:
            return {}
        whole, step = prefill.estimate(resolved), decode.estimate(resolved)
        return {"predicted_prefill_ms": whole.prefill_s * 1e3, "predicted_tokens_per_s": 1 / step.decode_s_per_token,
                "predicted_memory_mib": [round(m, 1) for m in whole.memory_mib],
                "predicted_cache_mib": [round(c, 1) for c in whole.cache_mib]}
    return predict


def measure(name: str, flags: list[str], model_path: str, cluster: str | None, world: int, out: Path,
            args) -> dict:
    """One launch of inference_plans.py for one plan: {"prefill_ms", "decode_tokens_per_s", "tokens",
    "peak_mib" (per device, testbed only), "status"}."""
    result = out / f"{slug(name)}.result.json"
    result.unlink(missing_ok=True)
    argv = ["bench/inference_plans.py", *flags, "--model_path", model_path, "--prompt", str(args.prompt),
            "--decode_prompt", str(args.decode_prompt), "--new", str(args.new), "--repeats", str(args.repeats),
            "--json", str(result)]
    if cluster:
        got = launch_on(cluster, argv, args.timeout, grace_s=60)
    else:
        got = {"peak_mib": [], "status": "ok"}
        try:
            run_ranks(argv, world, [None] * world, timeout=args.timeout)
        except RuntimeError as e:               # its last line: the rank's error
            got["status"] = "failed: " + [line for line in str(e).splitlines() if line.strip()][-1][:200]
    if got["status"] == "ok":
        got.update(next(iter(json.loads(result.read_text())["plans"].values())))
    return got


def subset_cluster(cluster: dict | None, ranks: list[int], out: Path) -> str | None:
    """A cluster file of the devices the searched plan uses (None: all of them, or no testbed)."""
    if cluster is None or len(ranks) == len(cluster["devices"]):
        return None
    path = out / "searched_devices.json"
    path.write_text(json.dumps({"devices": [cluster["devices"][r] for r in ranks]}, indent=1))
    return str(path)


def plans_to_run(searched: str, world: int, layers: int, alone: str | None, ranks: list[int],
                 searched_cluster: str | None) -> dict[str, dict]:
    """{name: {"flags" for inference_plans.py, "plan", "world", "cluster"}}: the searched plan (on
    the devices it uses), the even presets, the device alone."""
    from inference_plans import named_plans
    plans = {"searched": {"flags": ["--plans", "--plan_file", f"searched={searched}"],
                          "plan": named_plans([], [f"searched={searched}"], len(ranks), layers)["searched"],
                          "world": len(ranks), **({"cluster": searched_cluster} if searched_cluster else {})}}
    for name in PRESETS:
        plans[f"even {name}"] = {"flags": ["--plans", name], "plan": named_plans([name], [], world, layers)[name]}
    plans["alone"] = {"flags": ["--plans", "serial"], "plan": named_plans(["serial"], [], 1, layers)["serial"],
                      "world": 1, "cluster": alone}
    return plans


def run_rounds(plans: dict, model_path: str, cluster: str | None, world: int, out: Path, args) -> dict:
    """Every plan --rounds times, the order reversed every other round; each keeps its runs."""
    results = {name: {"runs": []} for name in plans}
    for k in range(args.rounds):
        for name in (list(plans) if k % 2 == 0 else list(plans)[::-1]):
            plan = plans[name]
            got = measure(name, plan["flags"], model_path, plan.get("cluster", cluster), plan.get("world", world),
                          out, args)
            results[name]["runs"].append(got)
            shown = f"prefill {got['prefill_ms']:8.1f} ms, decode {got['decode_tokens_per_s']:6.2f} tokens/s" \
                if "prefill_ms" in got else got["status"]
            print(f"round {k + 1} {name:<16} {shown}, peak MiB {got['peak_mib']}", flush=True)
    return results


def same_as_searched(plans: dict, model_path: str, world: int, prompt: int) -> list[str]:
    """The even plans that resolve to the searched plan (their ratios to it are noise, not gains)."""
    from galaxy.models.shape import read_model_shape
    from galaxy.plan import PlanError, Workload
    work = Workload.of(read_model_shape(model_path), prompt)

    def resolved(plan):
        try:
            return plan.resolve(world, work)
        except PlanError:
            return None
    if plans["searched"].get("world", world) != world:
        return []
    searched = resolved(plans["searched"]["plan"])
    return [n for n, p in plans.items() if n not in ("searched", "alone") and resolved(p["plan"]) == searched]


def best_of(runs: list[dict]) -> dict:
    """The run with the quickest prefill (the least disturbed: a shared host's spells slow whole
    runs), else the last failure."""
    done = [r for r in runs if "prefill_ms" in r]
    return min(done, key=lambda r: r["prefill_ms"]) if done else runs[-1]


def rows(plans: dict, results: dict, predictions: dict) -> dict:
    """{name: the best run's figures, the predictions and measured / predicted}."""
    out = {}
    for name in plans:
        r = {**best_of(results[name]["runs"]), **predictions[name], "runs": results[name]["runs"]}
        if "prefill_ms" in r and r.get("predicted_prefill_ms"):
            r["prefill_measured_over_predicted"] = r["prefill_ms"] / r["predicted_prefill_ms"]
            r["decode_measured_over_predicted"] = r["decode_tokens_per_s"] / r["predicted_tokens_per_s"]
        out[name] = r
    return out


def plan_lines(table: dict) -> list[str]:
    lines = [f"{'plan':<16} {'prefill ms: predicted':>21} {'measured':>9} {'ratio':>6}   "
             f"{'decode tok/s: predicted':>23} {'measured':>9} {'ratio':>6}   peak MiB measured / predicted (KV cache)"]
    for name, r in table.items():
        pred = f"{r.get('predicted_prefill_ms', 0):21.1f}" if r.get("predicted_prefill_ms") else f"{'-':>21}"
        dec = f"{r.get('predicted_tokens_per_s', 0):23.2f}" if r.get("predicted_tokens_per_s") else f"{'-':>23}"
        if "prefill_ms" not in r:
            lines.append(f"{name:<16} {pred} {'':>9} {'':>6}   {dec}   {r['status'][:90]}")
            continue
        memory = ", ".join(f"{m if m is None else round(m)}/{q:.0f} ({c:.1f})" for m, q, c in zip(
            r["peak_mib"] or [None] * len(r.get("predicted_memory_mib", [])), r.get("predicted_memory_mib", []),
            r.get("predicted_cache_mib", [])))
        lines.append(f"{name:<16} {pred} {r['prefill_ms']:9.1f} {r.get('prefill_measured_over_predicted', 0):6.3f}   "
                     f"{dec} {r['decode_tokens_per_s']:9.2f} {r.get('decode_measured_over_predicted', 0):6.3f}   {memory}")
    return lines


def speedup_lines(table: dict) -> list[str]:
    """The searched plan's prefill and decode against the device alone and each even plan (issue
    31's targets: prefill at most 0.8x the device alone and even Megatron TP+SP on home3)."""
    s = table["searched"]
    if "prefill_ms" not in s:
        return [f"searched plan did not run: {s['status']}"]
    lines = []
    for name, r in table.items():
        if name != "searched":
            lines.append(f"searched against {name:<16} " + (
                f"prefill {s['prefill_ms'] / r['prefill_ms']:.3f}x, decode tokens/s "
                f"{s['decode_tokens_per_s'] / r['decode_tokens_per_s']:.3f}x" if "prefill_ms" in r else r["status"][:90])
                + (" (the same plan)" if r.get("same_plan_as_searched") else ""))
    first = {n: r["tokens"] for n, r in table.items() if "tokens" in r}
    lines.append("greedy tokens equal across plans: " + ("yes" if len({json.dumps(t) for t in first.values()}) <= 1
                                                          else "NO"))
    for name, r in table.items():
        for rank, parts in enumerate(r.get("prefill_parts_ms") or ()):
            lines.append(f"{name} rank {rank} chunked prefill ms: " + ", ".join(f"{k} {v}" for k, v in parts.items()))
    errors = [abs(r[k] - 1) for r in table.values() for k in ("prefill_measured_over_predicted",) if k in r]
    if errors:
        lines.append(f"prefill |measured / predicted - 1|: median {statistics.median(errors):.3f}, "
                     f"max {max(errors):.3f} over {len(errors)} plans")
    return lines


def chart(table: dict, path: Path, title: str) -> None:
    """Predicted against measured prefill and decode, one bar pair per plan."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(11, 4))
    FigureCanvasAgg(fig)
    names = [n for n, r in table.items() if "prefill_ms" in r]
    for i, (key, pred, label) in enumerate((("prefill_ms", "predicted_prefill_ms", "prefill (ms)"),
                                            ("decode_tokens_per_s", "predicted_tokens_per_s", "decode (tokens/s)"))):
        ax = fig.add_subplot(1, 2, i + 1)
        y = range(len(names))
        ax.barh([v + 0.2 for v in y], [table[n].get(pred) or 0 for n in names], 0.4, label="predicted", color="tab:grey")
        ax.barh([v - 0.2 for v in y], [table[n][key] for n in names], 0.4, label="measured", color="tab:green")
        ax.set_yticks(list(y), names)
        ax.set(xlabel=label, title=title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cluster", help="a cluster file (clusters/*.json); absent: loopback ranks, --world of them")
    p.add_argument("--world", type=int, default=2, help="ranks over loopback (without --cluster)")
    p.add_argument("--prompt", type=int, default=512, help="prefill prompt tokens (and the base config's pad_size)")
    p.add_argument("--decode_prompt", type=int, default=32, help="prompt tokens before the decode rate's run")
    p.add_argument("--new", type=int, default=32, help="tokens generated (the search's --new_tokens)")
    p.add_argument("--repeats", type=int, default=3, help="inference_plans.py --repeats per launch")
    p.add_argument("--rounds", type=int, default=2, help="launches per plan, alternating the plans' order")
    p.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"])
    p.add_argument("--hidden", type=int, default=SHAPE["hidden_size"])
    p.add_argument("--profile_repeats", type=int, default=3, help="profile-devices --repeats")
    p.add_argument("--profile_statistic", choices=("median", "min", "mean"),
                   help="profile-devices --statistic (default: mean on the testbed, as profile-devices picks under a "
                        "CPU quota; median over loopback)")
    p.add_argument("--profile_objective", choices=("latency", "step"), default="latency",
                   help="profile-devices --objective (default latency: forward only and a measured decode step, "
                        "what fits home3's pi; step: the training profile)")
    p.add_argument("--only", nargs="+", metavar="NAME", choices=["searched", *(f"even_{n}" for n in PRESETS), "alone"],
                   help="run only these plans (the searched plan always runs): even_megatron, even_tp, ..., alone")
    p.add_argument("--reuse_profiles", action="store_true",
                   help="keep --out's model.json and devices.json from an earlier run (same cluster and shape)")
    p.add_argument("--timeout", type=float, default=900, help="seconds one launch may take")
    p.add_argument("--out")
    args = p.parse_args()
    if not 1 <= args.decode_prompt <= args.prompt or args.new < 2 or args.prompt + args.new > 2048:
        p.error("need 1 <= --decode_prompt <= --prompt, --new >= 2 and --prompt + --new <= 2048")
    return args


def main() -> None:
    args = parse_args()
    cluster_doc = json.loads(Path(args.cluster).read_text()) if args.cluster else None
    world = len(cluster_doc["devices"]) if cluster_doc else args.world
    name = Path(args.cluster).stem if args.cluster else f"loopback{world}"
    out = ROOT / (args.out or f"runs/bench/latency_cluster_{name}")
    out.mkdir(parents=True, exist_ok=True)
    model_path, base = write_inputs(out, bench_shape(args.layers, args.hidden), args.prompt)
    use_cluster(args.cluster)
    t0 = time.time()
    statistic = args.profile_statistic or ("mean" if args.cluster else "median")
    model_json, devices_json = str(out / "model.json"), str(out / "devices.json")
    if not (args.reuse_profiles and Path(model_json).exists() and Path(devices_json).exists()):
        # profile-devices times the 8 x 1024 model's sub-blocks at 512 tokens on each device: on
        # home3's 0.35-cpu device that is minutes (its LM head alone does 100 GFLOP a call)
        try:
            model_json, devices_json = profile(out, base, world, [None] * world, args.profile_repeats, statistic,
                                               timeout=3600, extra=("--objective", args.profile_objective))
        except RuntimeError as e:           # e.g. a device killed for memory: the testbed's line says so
            sys.exit("profile-devices failed: " + " | ".join(line for line in str(e).splitlines()
                                                             if "out of memory" in line or "rror" in line)[-400:])
    searched = search(out, base, model_json, devices_json, args)
    print(f"profiles and search: {time.time() - t0:.0f} s", flush=True)
    alone_cluster, alone = one_device_cluster(cluster_doc, out) if cluster_doc else (None, 0)
    ranks = json.loads((out / "plans.json").read_text()).get("device_ranks") or list(range(world))
    plans = plans_to_run(searched, world, args.layers, alone_cluster, ranks, subset_cluster(cluster_doc, ranks, out))
    if args.only:
        plans = {n: p for n, p in plans.items() if n == "searched" or n.replace(" ", "_") in args.only}
    predict = predictor(model_json, devices_json, model_path, args)
    predictions = {n: predict(p["plan"]) for n, p in plans.items() if n not in ("alone", "searched")}
    predictions["searched"] = predictor(model_json, devices_json, model_path, args, only=tuple(ranks))(
        plans["searched"]["plan"])
    predictions["alone"] = predictor(model_json, devices_json, model_path, args, only=(alone,))(plans["alone"]["plan"])
    table = rows(plans, run_rounds(plans, model_path, args.cluster, world, out, args), predictions)
    for name in same_as_searched(plans, model_path, world, args.prompt):
        table[name]["same_plan_as_searched"] = True
    lines = plan_lines(table) + speedup_lines(table)
    print("\n".join(lines), flush=True)
    for r in table.values():
        r.pop("tokens", None)
    (out / "results.json").write_text(json.dumps({"cluster": args.cluster, "world": world, "args": vars(args),
                                                  "results": table, "summary": lines}, indent=1, default=str))
    chart(table, out / "latency.png", f"{name}: prompt {args.prompt}, decode after {args.decode_prompt}")
    print(f"wrote {out / 'results.json'} and {out / 'latency.png'}")


if __name__ == "__main__":
    main()
