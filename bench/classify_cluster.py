"""The latency planner for an encoder classifier on an emulated cluster: `plan.py search --objective
latency`'s plan for one classification, predicted and measured, against even Megatron TP+SP and the
fastest device alone (issue 31, item 4, the encoder case).

On the edge testbed (`python -m galaxy.edge run --cluster FILE`), with bench/classify_latency.py's
classifier (all-MiniLM-L6-v2 and a 2-class head; written once to --out/model), batch 1, one
--tokens-token input (512: the model's positions, the base config's pad_size):

  1. plan.py profile-model (host) and profile-devices --objective latency (inside the testbed),
     then plan.py search --objective latency --json
  2. bench/classify_plans.py, each plan in its own launch, --rounds times, alternating their order:
     the searched plan (on the devices it uses), even Megatron TP+SP over every device (and any
     --even presets), the fastest device (the most cpus) alone, and where the search left a device
     out its best plan on every device (what holds that plan back); each plan's quickest launch counts
  3. per plan: predicted and measured forward, their ratio, each device's peak memory (the
     testbed's cgroup figure) against the prediction; where the time went on every rank (wall,
     CPU, blocked, kernels, Python: bench/step_terms.py); the searched plan's ratios to the
     device alone (target 0.7x on two_equal_1g, 0.8x on home3) and to even Megatron (0.8x on
     home3); results.json in --out

    flock /work/testbed.lock timeout 600 .venv/bin/python bench/classify_cluster.py \\
        --cluster clusters/two_equal_1g.json [--tokens 512] [--repeats 5] [--rounds 1] [--out DIR]

needs root (the testbed); every testbed command runs one after the other.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from planning_runs import ROOT, env, profile, use_cluster
from plan_cluster import launch_on, one_device_cluster, slug
from latency_cluster import subset_cluster

CLASSES = ["negative", "positive"]
TARGETS = {"two_equal_1g": {"alone": 0.7}, "home3": {"alone": 0.8, "even megatron": 0.8}}


def write_inputs(out: Path, tokens: int) -> tuple[str, str]:
    """The classifier (written once) and its base config: batch 1, pad_size = the input's tokens."""
    from classify_latency import write_classifier
    model = out / "model"
    if not (model / "model.safetensors").exists():
        write_classifier(str(model))
    base = {"model_path": str(model), "class_list": CLASSES, "pad_size": tokens, "batch_size": 1, "dropout": 0.0,
            "learning_rate": 1e-4, "max_steps": 1, "seed": 42, "timeout_s": 120}
    path = out / "base.json"
    path.write_text(json.dumps(base, indent=1))
    return str(model), str(path)


def search(out: Path, base: str, model_json: str, devices_json: str, name: str = "searched", *extra: str) -> str:
    """plan.py search --objective latency (extra: more flags); the written config's path (its
    plans: NAME-plans.json)."""
    searched = out / f"{name}.json"
    done = subprocess.run([sys.executable, "plan.py", "search", "--config_file", base, "--devices", devices_json,
                           "--model", model_json, "--objective", "latency", "--out", str(searched), "--json",
                           str(out / f"{name}-plans.json"), "--top", "10", *extra], cwd=ROOT, env=env(),
                          capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"plan.py search --objective latency failed:\n{done.stdout}{done.stderr}")
    print(done.stdout, flush=True)
    return str(searched)


def predictor(model_json: str, devices_json: str, model_path: str, tokens: int, only: tuple | None = None):
    """Plan -> {"predicted_ms", "predicted_memory_mib"} of the encoder cost model (only: those
    devices' ranks, the link among them as the search sees it); {} for a plan that cannot be formed."""
    from galaxy.models.shape import read_model_shape
    from galaxy.plan import PlanError, Workload
    from galaxy.planner.encoder_latency import EncoderLatencyCostModel
    from galaxy.planner.latency_devices import sub_link
    from galaxy.planner.profiles import load_devices, read_json
    model, (devices, link) = read_json(model_json), load_devices(devices_json)
    if only is not None:
        devices, link = [devices[r] for r in only], sub_link(link, tuple(only), len(devices))
    cost = EncoderLatencyCostModel(model, devices, link)
    work = Workload.of(read_model_shape(model_path), tokens)

    def predict(plan) -> dict:
        try:
            est = cost.estimate(plan.resolve(len(devices), work))
        except PlanError:
            return {}
        return {"predicted_ms": est.step_s * 1e3, "predicted_memory_mib": [round(m, 1) for m in est.memory_mib],
                "predicted_compute_ms": [round(c * 1e3, 1) for c in est.compute_s],
                "predicted_comm_ms": round(est.comm_s * 1e3, 1)}
    return predict


def plans_to_run(searched: str, world: int, layers: int, alone: str, ranks: list[int], searched_cluster,
                 even: list[str]) -> dict[str, dict]:
    """{name: {"flags" for classify_plans.py, "plan", "world", "cluster"}}."""
    from inference_plans import named_plans
    plans = {"searched": {"flags": ["--plan_file", f"searched={searched}"],
                          "plan": named_plans([], [f"searched={searched}"], len(ranks), layers)["searched"],
                          "world": len(ranks), "cluster": searched_cluster}}
    for name in ["megatron", *even]:
        plans[f"even {name}"] = {"flags": ["--plans", name], "plan": named_plans([name], [], world, layers)[name],
                                 "world": world, "cluster": None}
    plans["alone"] = {"flags": ["--plans", "serial"], "plan": named_plans(["serial"], [], 1, layers)["serial"],
                      "world": 1, "cluster": alone}
    return plans


def run_rounds(plans: dict, model_path: str, cluster: str, out: Path, args) -> dict:
    """Every plan --rounds times, the order reversed every other round: {name: [launch results]}."""
    runs = {name: [] for name in plans}
    for k in range(args.rounds):
        for name in (list(plans) if k % 2 == 0 else list(plans)[::-1]):
            plan, result = plans[name], out / f"{slug(name)}.result.json"
            result.unlink(missing_ok=True)
            argv = ["bench/classify_plans.py", *plan["flags"], "--model_path", model_path, "--tokens", str(args.tokens),
                    "--repeats", str(args.repeats), "--json", str(result)]
            got = launch_on(plan["cluster"] or cluster, argv, args.timeout, grace_s=60)
            if got["status"] == "ok":
                got.update(next(iter(json.loads(result.read_text())["plans"].values())))
            runs[name].append(got)
            shown = f"forward {got['forward_ms']:8.1f} ms" if "forward_ms" in got else got["status"]
            print(f"round {k + 1} {name:<16} {shown}, peak MiB {got['peak_mib']}", flush=True)
    return runs


def table_lines(table: dict, cluster_name: str) -> list[str]:
    lines = [f"{'plan':<16} {'forward ms: predicted':>21} {'measured':>9} {'ratio':>6}   peak MiB measured / predicted"]
    for name, r in table.items():
        pred = f"{r['predicted_ms']:21.1f}" if r.get("predicted_ms") else f"{'-':>21}"
        if "forward_ms" not in r:
            lines.append(f"{name:<16} {pred}   {r['status'][:90]}")
            continue
        memory = ", ".join(f"{m if m is None else round(m)}/{q:.0f}" for m, q in zip(
            r["peak_mib"] or [None] * len(r.get("predicted_memory_mib", [])), r.get("predicted_memory_mib", [])))
        ratio = r["forward_ms"] / r["predicted_ms"] if r.get("predicted_ms") else 0.0
        lines.append(f"{name:<16} {pred} {r['forward_ms']:9.1f} {ratio:6.3f}   {memory}")
    for name, r in table.items():
        for i, t in enumerate(r.get("terms") or ()):
            lines.append(f"  {name} rank {i}: wall {t['wall_ms']:.0f} ms = cpu {t['cpu_ms']:.0f} (kernels "
                         f"{t['kernels_ms']:.0f}, python {t['python_ms']:.0f}) + blocked {t['blocked_ms']:.0f}")
    s = table["searched"]
    for other in ("alone", "even megatron"):
        target = TARGETS.get(cluster_name, {}).get(other)
        r = table.get(other, {})
        if "forward_ms" in s and "forward_ms" in r:
            ratio = s["forward_ms"] / r["forward_ms"]
            verdict = "" if target is None else f" (target {target}x: {'met' if ratio <= target else 'missed'})"
            same = " (the same plan: launch-to-launch noise)" if s.get("same_plan_as") == other else ""
            lines.append(f"searched / {other}: {ratio:.3f}x{verdict}{same}")
    probs = [r["probabilities"] for r in table.values() if "probabilities" in r]
    gap = max((abs(a - b) for p in probs for a, b in zip(p, probs[0])), default=0.0)
    lines.append(f"probabilities' largest difference across plans: {gap:.2e}")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cluster", required=True, help="a cluster file (clusters/*.json)")
    p.add_argument("--tokens", type=int, default=512, help="the input's tokens (the base config's pad_size)")
    p.add_argument("--repeats", type=int, default=5, help="classify_plans.py --repeats per launch")
    p.add_argument("--rounds", type=int, default=1, help="launches per plan, alternating the plans' order")
    p.add_argument("--even", nargs="*", default=[], choices=["tp", "sp", "galaxy2", "pipeline"],
                   help="also run these even presets over every device")
    p.add_argument("--profile_repeats", type=int, default=3)
    p.add_argument("--reuse_profiles", action="store_true", help="keep --out's model.json and devices.json")
    p.add_argument("--timeout", type=float, default=240, help="seconds one launch may take")
    p.add_argument("--out")
    args = p.parse_args()
    cluster = json.loads(Path(args.cluster).read_text())
    world, name = len(cluster["devices"]), Path(args.cluster).stem
    out = ROOT / (args.out or f"runs/bench/classify_cluster_{name}")
    out.mkdir(parents=True, exist_ok=True)
    model_path, base = write_inputs(out, args.tokens)
    use_cluster(args.cluster)
    t0 = time.time()
    model_json, devices_json = str(out / "model.json"), str(out / "devices.json")
    if not (args.reuse_profiles and Path(model_json).exists() and Path(devices_json).exists()):
        model_json, devices_json = profile(out, base, world, [None] * world, args.profile_repeats, "mean",
                                           timeout=600, extra=("--objective", "latency"))
    searched = search(out, base, model_json, devices_json)
    print(f"profiles and search: {time.time() - t0:.0f} s", flush=True)
    alone_cluster, alone = one_device_cluster(cluster, out)
    ranks = json.loads((out / "searched-plans.json").read_text()).get("device_ranks") or list(range(world))
    layers = json.loads((Path(model_path) / "config.json").read_text())["num_hidden_layers"]
    plans = plans_to_run(searched, world, layers, alone_cluster, ranks, subset_cluster(cluster, ranks, out), args.even)
    if len(ranks) < world:       # the best plan on every device: what holds it back
        from inference_plans import named_plans
        every = search(out, base, model_json, devices_json, "every_device", "--all_devices")
        plans["searched, every device"] = {"flags": ["--plan_file", f"every={every}"], "world": world, "cluster": None,
                                           "plan": named_plans([], [f"every={every}"], world, layers)["every"]}
    predictions = {n: predictor(model_json, devices_json, model_path, args.tokens)(p["plan"])
                   for n, p in plans.items() if n not in ("alone", "searched")}
    predictions["searched"] = predictor(model_json, devices_json, model_path, args.tokens, tuple(ranks))(
        plans["searched"]["plan"])
    predictions["alone"] = predictor(model_json, devices_json, model_path, args.tokens, (alone,))(plans["alone"]["plan"])
    runs = run_rounds(plans, model_path, str(Path(args.cluster).resolve()), out, args)
    table = {}
    for n in plans:
        done = [r for r in runs[n] if "forward_ms" in r]
        table[n] = {**(min(done, key=lambda r: r["forward_ms"]) if done else runs[n][-1]), **predictions[n],
                    "launches": len(runs[n])}
    if ranks == [alone]:
        table["searched"]["same_plan_as"] = "alone"       # the search chose the device alone: ratios are noise
    lines = table_lines(table, name)
    print("\n".join(lines), flush=True)
    (out / "results.json").write_text(json.dumps({"cluster": args.cluster, "world": world, "device_ranks": ranks,
                                                  "args": vars(args), "results": table, "summary": lines},
                                                 indent=1, default=str))
    print(f"wrote {out / 'results.json'}")


if __name__ == "__main__":
    main()
