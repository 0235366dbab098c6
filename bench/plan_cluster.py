"""The searched plan on an emulated cluster against the plans users write, its neighbours and the fastest device alone.

Everything runs on the edge testbed (`python -m galaxy.edge run --cluster FILE`: one rank per
device, its CPU share, memory limit and shaped link), on all-MiniLM-L6-v2 classification:

  1. plan.py profile-model (host) and profile-devices (inside the testbed: the devices' GEMM
     rates, memory limits, collectives and every pair's sends), then plan.py search --json
  2. the searched plan trains --steps steps under pretrain_galaxy.py, and so do:
     - the plans a user writes without a planner, each even over every device: DDP, Megatron
       TP+SP (ATT TP, MLP TP, CON SP), SP everywhere, a pipeline of as-equal stages (--micro
       micro-batches, 1F1B); one that does not fit a device is killed there and reported so;
     - the fastest device training alone (the most cpus; a cluster of that one device);
     - its neighbours: the next --neighbours plans of the search's ranking (other stage splits,
       micro-batches, schedules, shares, meshes, recomputation);
  3. the searched plan and the --final_top fastest others train --final_rounds more times,
     alternating; each counts its least disturbed run (a shared host's spells slow whole runs).

It prints every plan's predicted and measured step time and peak memory per device (the memory
cgroup's peak, as the testbed reports it), the searched plan's speed-up over each user plan and
over the device alone, searched / best measured, and writes results.json and plans.png (predicted
against measured, and the user plans' bars) to --out.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/plan_cluster.py --cluster clusters/home3.json
        [--method full|lora] [--batch_size 8] [--pad_size 128] [--steps 5] [--neighbours 20]
        [--micro 4] [--final_top 3] [--final_rounds 2] [--out runs/bench/plan_cluster_home3_full]

needs root (the testbed).
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from plan_accuracy import method_keys
from planning_runs import ROOT, env, profile, use_cluster, write_base

DEVICE_LINE = re.compile(r"galaxy\.edge: device (\S+) \(rank (\d+)\): exit (-?\d+), peak memory (\S+) of")
KILLED_LINE = re.compile(r"(\S+) (was killed|lost a process): out of memory.*")


def user_plans(world: int, layers: int, micro: int) -> dict[str, dict]:
    """The plans a user writes without a planner: each even over every device."""
    group = {"pp_deg": 1, "dp_deg": 1}
    stages = [layers // world + (1 if i < layers % world else 0) for i in range(world)]
    return {"even DDP": {"pp_deg": 1, "dp_deg": world},
            "even Megatron TP+SP": {**group, "att_parallel_method": "TP", "mlp_parallel_method": "TP",
                                    "con_parallel_method": "SP"},
            "even SP": {**group, "att_parallel_method": "SP", "mlp_parallel_method": "SP", "con_parallel_method": "SP"},
            "even pipeline": {"pp_deg": world, "dp_deg": 1, "stage_num_hidden_layers_list": stages,
                              "num_microbatches": micro, "pipeline_schedule": "1f1b"}}


def one_device_cluster(cluster: dict, out: Path) -> tuple[str, str]:
    """A cluster of the device with the most cpus alone: (its file, its name)."""
    fastest = max(cluster["devices"], key=lambda d: d["cpus"])
    path = out / "alone.json"
    path.write_text(json.dumps({"devices": [fastest]}, indent=1))
    return str(path), fastest["name"]


def run_on(cluster: str, out: Path, base: str, name: str, keys: dict, timeout: float) -> dict:
    """Train base + keys on the testbed: {"step_s" (median after the first step), "step_times",
    "peak_mib" (per device: the cgroup's), "status": "ok" | the failure's line}."""
    cfg = {**json.loads(Path(base).read_text()), **keys, "metrics_file": str(out / f"{slug(name)}.jsonl")}
    path = out / f"{slug(name)}.json"
    path.write_text(json.dumps(cfg, indent=1))
    Path(cfg["metrics_file"]).unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "galaxy.edge", "run", "--cluster", cluster, "--", sys.executable,
           "pretrain_galaxy.py", "--config_file", str(path)]
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)
        text, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:      # the launcher's own timeout_s should come first
        text, code = (e.stdout or b"").decode() + (e.stderr or b"").decode(), -1
    peaks = {int(m[2]): (float(m[4]) if m[4] != "?" else None) for m in DEVICE_LINE.finditer(text)}
    got = {"peak_mib": [peaks.get(r) for r in sorted(peaks)], "status": "ok"}
    if code:
        killed = KILLED_LINE.search(text)
        got["status"] = killed.group(0) if killed else f"exit {code}: " + (text.strip().splitlines() or ["?"])[-1][:200]
        return got
    records = [json.loads(line) for line in Path(cfg["metrics_file"]).read_text().splitlines()]
    times = [r["time_s"] for r in records if "event" not in r and "time_s" in r]
    got.update(step_s=statistics.median(times[1:] or times), step_times=times)
    return got


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def candidates(ranked: list[dict], world: int, layers: int, args) -> dict[str, dict]:
    """{name: {"keys", "predicted_step_s", "predicted_memory_mib" | absent}}: the searched plan, the
    user plans (with their predictions where the search ranked them), the neighbours."""
    def key_of(keys):
        return json.dumps(keys, sort_keys=True)
    by_keys = {key_of(p["keys"]): p for p in ranked}
    out = {"searched": ranked[0]}
    for name, keys in user_plans(world, layers, args.micro).items():
        out[name] = {"keys": keys, **{k: v for k, v in by_keys.get(key_of(keys), {}).items() if k != "keys"}}
    for i, p in enumerate(ranked[1:args.neighbours + 1], start=2):
        out[f"neighbour {i}"] = p
    return out


def describe(keys: dict) -> str:
    if keys.get("pp_deg", 1) > 1:
        return (f"pp {keys['pp_deg']} stages {keys.get('stage_num_hidden_layers_list', 'even')} "
                f"micro {keys.get('num_microbatches', 1)} {keys.get('pipeline_schedule', '')}")
    if keys.get("dp_deg", 1) > 1:
        return f"dp {keys['dp_deg']}"
    shares = " ".join(f"{k.split('_')[1]} {v}" for k, v in keys.items() if k.endswith("_list"))
    return (f"group ATT {keys.get('att_parallel_method')} MLP {keys.get('mlp_parallel_method')} "
            f"CON {keys.get('con_parallel_method')} {shares or 'even'}").strip()


def chart(results: dict, path: Path, title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(11, 4.5))
    FigureCanvasAgg(fig)
    ax, bars = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    pairs = [(r["predicted_step_s"], r["best_s"], n) for n, r in results.items()
             if r.get("predicted_step_s") and r.get("best_s")]
    ax.scatter([p[0] for p in pairs], [p[1] for p in pairs], s=14)
    top = max(max(p[0], p[1]) for p in pairs) * 1.1
    ax.plot([0, top], [0, top], lw=0.8, color="grey")
    for pred, meas, name in pairs:
        if not name.startswith("neighbour"):
            ax.annotate(name, (pred, meas), fontsize=7)
    ax.set(xlabel="predicted step (s)", ylabel="measured step (s)", title="predicted against measured",
           xscale="log", yscale="log")
    names = [n for n in results if not n.startswith("neighbour")]
    values = [results[n].get("best_s") or 0.0 for n in names]
    bars.barh(names, values, color=["tab:green" if n == "searched" else "tab:grey" for n in names])
    for i, n in enumerate(names):
        if not results[n].get("best_s"):
            bars.text(0, i, "  " + results[n]["status"][:60], va="center", fontsize=7, color="tab:red")
    bars.set(xlabel="measured step (s)", title=title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cluster", required=True)
    p.add_argument("--method", choices=("full", "lora"), default="full")
    p.add_argument("--lora_dim", type=int, default=8)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--pad_size", type=int, default=128)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--micro", type=int, default=4, help="micro-batches of the even pipeline")
    p.add_argument("--neighbours", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3, help="profile-devices --repeats")
    p.add_argument("--final_top", type=int, default=3)
    p.add_argument("--final_rounds", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600, help="seconds a run may take")
    p.add_argument("--out")
    args = p.parse_args()
    cluster_doc = json.loads(Path(args.cluster).read_text())
    world = len(cluster_doc["devices"])
    out = ROOT / (args.out or f"runs/bench/plan_cluster_{Path(args.cluster).stem}_{args.method}")
    out.mkdir(parents=True, exist_ok=True)
    # timeout_s: a peer of a device killed for memory stops within it (the slowest plan's step
    # here, even DDP's 90 MB all-reduce over 100 Mbit/s, takes about 15 s)
    base = write_base(out, pad_size=args.pad_size, batch_size=args.batch_size, steps=args.steps, timeout_s=120,
                      **method_keys(None if args.method == "full" else args.method, args.lora_dim))
    use_cluster(args.cluster)
    t0 = time.time()
    model_path, devices_path = profile(out, base, world, [None] * world, args.repeats)
    search = subprocess.run([sys.executable, "plan.py", "search", "--config_file", base, "--devices", devices_path,
                             "--model", model_path, "--out", str(out / "searched.json"), "--json",
                             str(out / "plans.json"), "--png", str(out / "searched.png"), "--top", "400"],
                            cwd=ROOT, env=env(), capture_output=True, text=True, check=True)
    print("\n".join(search.stdout.splitlines()[:8]), flush=True)
    print(f"profiles and search: {time.time() - t0:.0f} s", flush=True)
    ranked = json.loads((out / "plans.json").read_text())["plans"]
    layers = json.loads(Path(model_path).read_text())["hf_config"]["num_hidden_layers"]
    plans = candidates(ranked, world, layers, args)
    alone_cluster, alone_name = one_device_cluster(cluster_doc, out)
    plans[f"{alone_name} alone"] = {"keys": {"pp_deg": 1, "dp_deg": 1}, "cluster": alone_cluster}
    results = {}

    def measure(name: str) -> dict:
        plan = plans[name]
        got = run_on(plan.get("cluster", args.cluster), out, base, name, plan["keys"], args.timeout)
        r = results.setdefault(name, {**{k: v for k, v in plan.items() if k != "cluster"}, "runs": []})
        r["runs"].append(got)
        r["status"] = got["status"]
        done = [x["step_s"] for x in r["runs"] if "step_s" in x]
        r["best_s"] = min(done) if done else None
        pred = plan.get("predicted_step_s")
        shown = f"{got['step_s'] * 1e3:8.0f} ms" if "step_s" in got else f"{got['status'][:60]}"
        print(f"{name:<22} {describe(plan['keys'])[:58]:<58} predicted "
              f"{(f'{pred * 1e3:6.0f}' if pred else '     -')} ms, measured {shown}, peak MiB {got['peak_mib']} "
              f"(predicted {plan.get('predicted_memory_mib', '-')})", flush=True)
        return got

    for name in plans:
        measure(name)
    finished = {n: r["best_s"] for n, r in results.items() if r["best_s"] and n != "searched"}
    finalists = ["searched"] + sorted(finished, key=finished.get)[: args.final_top]
    for k in range(args.final_rounds):
        for name in finalists if k % 2 else finalists[::-1]:
            measure(name)
    summarise(results, out, args, world)


def summarise(results: dict, out: Path, args, world: int) -> None:
    s = results["searched"]["best_s"]
    lines = [f"\nsearched {s * 1e3:.0f} ms (predicted {results['searched']['predicted_step_s'] * 1e3:.0f} ms: "
             f"measured / predicted {s / results['searched']['predicted_step_s']:.3f})"]
    for name, r in results.items():
        if name.startswith("even") or name.endswith("alone"):
            lines.append(f"  against {name}: " + (f"{r['best_s'] / s:.2f}x" if r["best_s"] else r["status"]))
    measured = {n: r["best_s"] for n, r in results.items() if r["best_s"] and not n.endswith("alone")}
    best = min(measured, key=measured.get)
    lines.append(f"  best of {len(measured)} measured plans: {best} {measured[best] * 1e3:.0f} ms; "
                 f"searched / best {s / measured[best]:.3f}")
    peaks = results["searched"]["runs"][0]["peak_mib"]
    pred = results["searched"].get("predicted_memory_mib") or []
    lines.append("  searched peak memory per device, measured / predicted: "
                 + ", ".join(f"{m:.0f}/{q:.0f} ({m / q:.2f})" for m, q in zip(peaks, pred) if m))
    print("\n".join(lines), flush=True)
    (out / "results.json").write_text(json.dumps({"results": results, "args": vars(args), "world": world,
                                                  "summary": lines}, indent=1, default=str))
    chart(results, out / "plans.png", f"{Path(args.cluster).stem}, {args.method}")
    print(f"wrote {out / 'results.json'} and {out / 'plans.png'}")


if __name__ == "__main__":
    main()
