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
       micro-batches, rows per data-parallel replica, schedules, shares, meshes, recomputation);
  3. the searched plan and the --final_top fastest others train --final_rounds more times,
     alternating; each counts its least disturbed run (a shared host's spells slow whole runs).

It prints every plan's predicted and measured step time and peak memory per device (the memory
cgroup's peak, as the testbed reports it: device i is launch rank i, whatever mesh position a
plan's mesh_rank_order gives it, and so is the cost model's predicted_memory_mib[i]:
galaxy.planner.placement), the searched plan's speed-up over each user plan and over the device
alone, searched / best measured, and writes results.json and plans.png (predicted against
measured, and the user plans' bars) to --out.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/plan_cluster.py --cluster clusters/home3.json
        [--method full|lora] [--batch_size 12] [--pad_size 128] [--steps 5] [--neighbours 20]
        [--micro 4] [--final_top 3] [--final_rounds 2] [--profile_statistic mean|median|min]
        [--out runs/bench/plan_cluster_home3_full]

needs root (the testbed).
"""
from __future__ import annotations

import argparse
import itertools
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
KILLED_LINE = re.compile(r"(\S+(?: \(rank \d+\))?) (was killed|lost a process): out of memory.*")


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


def fastest_device(cluster: dict) -> int:
    """The index of the device with the most cpus."""
    return max(range(len(cluster["devices"])), key=lambda i: cluster["devices"][i]["cpus"])


def one_device_cluster(cluster: dict, out: Path) -> tuple[str, int]:
    """A cluster of the device with the most cpus alone: (its file, its index)."""
    index = fastest_device(cluster)
    path = out / "alone.json"
    path.write_text(json.dumps({"devices": [cluster["devices"][index]]}, indent=1))
    return str(path), index


def run_on(cluster: str, out: Path, base: str, name: str, keys: dict, timeout: float) -> dict:
    """Train base + keys on the testbed: {"step_s" (median after the first step), "step_times",
    "peak_mib" (per device: the cgroup's), "status": "ok" | the failure's line}."""
    cfg = {**json.loads(Path(base).read_text()), **keys, "metrics_file": str(out / f"{slug(name)}.jsonl")}
    path = out / f"{slug(name)}.json"
    path.write_text(json.dumps(cfg, indent=1))
    Path(cfg["metrics_file"]).unlink(missing_ok=True)
    got = launch_on(cluster, ["pretrain_galaxy.py", "--config_file", str(path)], timeout)
    if got["status"] != "ok":
        return got
    records = [json.loads(line) for line in Path(cfg["metrics_file"]).read_text().splitlines()]
    times = [r["time_s"] for r in records if "event" not in r and "time_s" in r]
    got.update(step_s=statistics.median(times[1:] or times), step_times=times)
    return got


def launch_on(cluster: str, argv: list[str], timeout: float, grace_s: float | None = None) -> dict:
    """`python *argv` as every device's rank on the testbed: {"peak_mib" (per device: the cgroup's),
    "status": "ok" | the failure's line (a device killed for memory: the testbed's line)}."""
    grace = ["--grace_s", str(grace_s)] if grace_s else []
    cmd = [sys.executable, "-m", "galaxy.edge", "run", *grace, "--cluster", cluster, "--", sys.executable, *argv]
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)
        text, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:      # the launcher's own timeout_s should come first
        text, code = (e.stdout or b"").decode() + (e.stderr or b"").decode(), -1
    peaks = {int(m[2]): (float(m[4]) if m[4] != "?" else None) for m in DEVICE_LINE.finditer(text)}
    got = {"peak_mib": [peaks.get(r) for r in sorted(peaks)], "status": "ok"}
    if code:
        killed = KILLED_LINE.search(text)
        errors = [line for line in text.splitlines() if "error" in line.lower()]
        got["status"] = killed.group(0) if killed else f"exit {code}: " + (errors or text.strip().splitlines() or ["?"])[0][:200]
    return got


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def candidates(ranked: list[dict], world: int, layers: int, args, predict) -> dict[str, dict]:
    """{name: {"keys", "predicted_step_s", "predicted_memory_mib"}}: the searched plan, the user
    plans and the searched plan's neighbours (neighbour_keys), each predicted by the cost model."""
    out = {"searched": ranked[0]}
    for name, keys in user_plans(world, layers, args.micro).items():
        out[name] = {"keys": keys, **predict(keys)}
    seen = {json.dumps(p["keys"], sort_keys=True) for p in out.values()}
    count = 0
    for keys in neighbour_keys(ranked[0]["keys"], layers, args.batch_size):
        key = json.dumps(keys, sort_keys=True)
        guess = predict(keys)
        if key in seen or not guess:
            continue
        seen.add(key)
        count += 1
        out[f"neighbour {count}"] = {"keys": keys, **guess}
        if count == args.neighbours:
            break
    return out


def neighbour_keys(keys: dict, layers: int, batch: int):
    """Plans one change away from `keys`, then two: a layer moved between neighbouring stages,
    another count of micro-batches, a row per micro-batch moved between two data-parallel replicas
    (dp_batch_list), the other schedule, torch's warm-ups, the devices in launch order or two
    neighbouring positions swapped (mesh_rank_order), a head / 64 MLP columns / 8 tokens moved
    between two ranks of the Galaxy group, another method for one sub-block, recomputation."""
    singles = list(_single_changes(keys, layers, batch))
    yield from singles
    for i, first in enumerate(singles):          # pairs of changes: a stage move with micro-batches
        for second in _single_changes(first, layers, batch):
            yield second


def _single_changes(keys: dict, layers: int, batch: int):
    stages = keys.get("stage_num_hidden_layers_list")
    if keys.get("pp_deg", 1) > 1 and stages:
        for i in range(len(stages) - 1):
            for d in (1, -1):
                moved = list(stages)
                moved[i] -= d
                moved[i + 1] += d
                if min(moved) >= 1:
                    yield {**keys, "stage_num_hidden_layers_list": moved}
    micro_key = "num_microbatches" if keys.get("pp_deg", 1) > 1 else "grad_accum_steps"
    micro = keys.get(micro_key, 1)
    rows = keys.get("dp_batch_list") or [batch // keys.get("dp_deg", 1)] * keys.get("dp_deg", 1)
    for m in sorted(range(1, batch + 1), key=lambda m: abs(m - micro)):      # the nearest counts first
        if m != micro and batch % keys.get("dp_deg", 1) == 0 and all(r % m == 0 for r in rows):
            changed = {**keys, micro_key: m} if m > 1 or micro_key == "num_microbatches" else \
                {k: v for k, v in keys.items() if k != micro_key}
            if "pipeline_warmup_list" in keys:       # no more warm-up forwards than micro-batches
                changed["pipeline_warmup_list"] = [min(w, m) for w in keys["pipeline_warmup_list"]]
            yield changed
    for i, j in itertools.permutations(range(len(rows)) if len(rows) > 1 else (), 2):
        if rows[i] - micro >= micro:                 # one row per micro-batch from replica i to j
            moved = list(rows)
            moved[i] -= micro
            moved[j] += micro
            yield {**keys, "dp_batch_list": moved} if len(set(moved)) > 1 else \
                {k: v for k, v in keys.items() if k != "dp_batch_list"}
    if keys.get("pp_deg", 1) > 1:
        other = "gpipe" if keys.get("pipeline_schedule") == "1f1b" else "1f1b"
        yield {k: v for k, v in keys.items() if k != "pipeline_warmup_list"} | {"pipeline_schedule": other}
    if "pipeline_warmup_list" in keys:               # torch's warm-ups
        yield {k: v for k, v in keys.items() if k != "pipeline_warmup_list"}
    order = keys.get("mesh_rank_order")
    if order:                                        # the devices in launch order, or two of them swapped
        yield {k: v for k, v in keys.items() if k != "mesh_rank_order"}
        for i in range(len(order) - 1):
            swapped = list(order)
            swapped[i], swapped[i + 1] = swapped[i + 1], swapped[i]
            yield {**keys, "mesh_rank_order": swapped}
    for share, step in (("tp_num_attention_heads_list", 1), ("tp_intermediate_size_list", 64),
                        ("seq_scatter_list", 8)):
        values = keys.get(share)
        for i in range(len(values or ())):
            for j in range(len(values or ())):
                if i != j and values[i] - step >= 1:
                    moved = list(values)
                    moved[i] -= step
                    moved[j] += step
                    yield {**keys, share: moved}
    group = keys.get("pp_deg", 1) * keys.get("dp_deg", 1)
    if keys.get("tp_num_attention_heads_list") or keys.get("seq_scatter_list") or group == 1:
        for method, other in (("att_parallel_method", {"TP": "SP", "SP": "TP"}),
                              ("mlp_parallel_method", {"TP": "SP", "SP": "TP"}),
                              ("con_parallel_method", {"SP": "None", "None": "SP"})):
            if keys.get(method) in other:
                yield {**keys, method: other[keys[method]]}
    if keys.get("activation_checkpointing", "none") == "none":
        yield {**keys, "activation_checkpointing": "full"}


def predictor(base: str, model_path: str, devices_path: str, world: int, args, only: int | None = None):
    """keys -> {"predicted_step_s", "predicted_memory_mib"} by the search's own cost model, or {}
    for keys that do not make a plan of this world (only: that device alone, world 1)."""
    from plan_accuracy import method_of
    from galaxy.models.shape import read_model_shape
    from galaxy.plan import Plan, PlanError, Workload
    from galaxy.planner.cost import CostModel
    from galaxy.planner.profiles import load_devices, read_json
    model = read_json(model_path)
    devices, link = load_devices(devices_path)
    if only is not None:
        devices, link = [devices[only]], None
    cost = CostModel(model, devices, link, batch_size=args.batch_size, method=method_of(base, model))
    work = Workload.of(read_model_shape(json.loads(Path(base).read_text())["model_path"]), args.pad_size,
                       args.batch_size)

    def predict(keys: dict) -> dict:
        try:
            est = cost.estimate(Plan.from_keys(keys).resolve(world, work))
        except PlanError:
            return {}
        return {"predicted_step_s": est.step_s, "predicted_memory_mib": [round(m, 1) for m in est.memory_mib]}
    return predict


def describe(keys: dict) -> str:
    recompute = "" if keys.get("activation_checkpointing", "none") == "none" else \
        f" recompute {keys['activation_checkpointing']}"
    accumulate = f" accumulate {keys['grad_accum_steps']}" if keys.get("grad_accum_steps", 1) > 1 else ""
    mesh = f"pp {keys.get('pp_deg', 1)} x dp {keys.get('dp_deg', 1)}"
    if keys.get("pp_deg", 1) > 1:
        mesh += (f" stages {keys.get('stage_num_hidden_layers_list', 'even')} micro {keys.get('num_microbatches', 1)} "
                 f"{keys.get('pipeline_schedule', '')}")
    shares = " ".join(f"{k.split('_')[1]} {v}" for k, v in keys.items() if k.endswith("_list") and k.startswith(("tp", "seq")))
    group = "" if not keys.get("att_parallel_method") or keys.get("pp_deg", 1) * keys.get("dp_deg", 1) > 1 and not shares \
        else f" ATT {keys['att_parallel_method']} MLP {keys['mlp_parallel_method']} CON {keys['con_parallel_method']} " \
        f"{shares or 'even'}"
    rows = f" rows {keys['dp_batch_list']}" if keys.get("dp_batch_list") else ""
    warm = f" warm-up {keys['pipeline_warmup_list']}" if keys.get("pipeline_warmup_list") else ""
    order = f" ranks {keys['mesh_rank_order']}" if keys.get("mesh_rank_order") else ""
    return mesh + warm + order + rows + group + accumulate + recompute


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


def accuracy(results: dict, predict=None) -> list[str]:
    """Predicted against measured over the plans that ran (predict: keys -> prediction, to cost
    them again from another profile): per plan, then Spearman and the median absolute error, by
    each plan's best run and again by its first (the pass that measures every plan once: a
    finalist's best of 3 runs sits lower than a plan measured once on a loaded host)."""
    from planning_runs import spearman
    rows = []
    for name, r in results.items():
        if not r.get("best_s") or name.endswith("alone"):
            continue
        pred = (predict(r["keys"]) if predict else r).get("predicted_step_s")
        first = next(x["step_s"] for x in r["runs"] if "step_s" in x)
        if pred:
            rows.append((name, pred, r["best_s"], first))
    lines = [f"  {n:<22} predicted {q * 1e3:6.0f} ms, measured {m * 1e3:6.0f} ms ({m / q:.3f})" for n, q, m, _ in rows]
    for label, k in (("best run", 2), ("first run", 3)):
        errors = sorted(abs(row[k] / row[1] - 1) for row in rows)
        lines.append(f"  {len(rows)} plans, each by its {label}: Spearman "
                     f"{spearman([row[1] for row in rows], [row[k] for row in rows]):.3f}, "
                     f"median |measured / predicted - 1| {statistics.median(errors):.3f}, "
                     f"{sum(e <= 0.15 for e in errors)} within 15%")
    return lines


def memory_agreement(results: dict, predict=None, alone=None) -> list[str]:
    """Each device of each run against its plan's predicted peak (predict / alone: keys ->
    prediction, to cost them again; alone for the device-alone plan): how many within 10%, and
    the ones outside (plan [rank] measured / predicted MiB). [rank] is the launch rank, the device:
    both lists are per device (module docstring)."""
    inside, outside = 0, []
    for name, r in results.items():
        got = (alone if name.endswith("alone") else predict) or (lambda keys: r)
        pred = got(r["keys"]).get("predicted_memory_mib") or []
        for run in r.get("runs", []):
            for rank, (m, q) in enumerate(zip(run.get("peak_mib") or [], pred)):
                if m and abs(m / q - 1) <= 0.10:
                    inside += 1
                elif m:
                    outside.append(f"{name} [{rank}] {m:.0f}/{q:.0f}")
    return [f"  memory: {inside} of {inside + len(outside)} device-runs within 10% of the prediction"
            + (f"; outside: {', '.join(outside)}" if outside else "")]


def repredict(folder: Path, devices_path: str, cluster: dict, args) -> None:
    """Cost a finished run's plans again from another devices profile (--repredict)."""
    done = json.loads((folder / "results.json").read_text())
    world = len(cluster["devices"])
    predict = predictor(str(folder / "base.json"), str(folder / "model.json"), devices_path, world, args)
    alone = predictor(str(folder / "base.json"), str(folder / "model.json"), devices_path, 1, args,
                      only=fastest_device(cluster))
    print("\n".join(accuracy(done["results"], predict) + memory_agreement(done["results"], predict, alone)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cluster", required=True)
    p.add_argument("--method", choices=("full", "lora"), default="full")
    p.add_argument("--lora_dim", type=int, default=8)
    p.add_argument("--batch_size", type=int, default=12, help="divisible by the devices (even DDP)")
    p.add_argument("--pad_size", type=int, default=128)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--micro", type=int, default=4, help="micro-batches of the even pipeline")
    p.add_argument("--neighbours", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3, help="profile-devices --repeats")
    p.add_argument("--profile_statistic", choices=("median", "min", "mean"), default="mean",
                   help="profile-devices --statistic (default mean, as profile-devices picks under the testbed's quotas)")
    p.add_argument("--final_top", type=int, default=3)
    p.add_argument("--final_rounds", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600, help="seconds a run may take")
    p.add_argument("--out")
    p.add_argument("--repredict", metavar="DEVICES_JSON",
                   help="cost the plans of a finished run in --out again from this devices profile; run nothing")
    args = p.parse_args()
    cluster_doc = json.loads(Path(args.cluster).read_text())
    world = len(cluster_doc["devices"])
    out = ROOT / (args.out or f"runs/bench/plan_cluster_{Path(args.cluster).stem}_{args.method}")
    if args.repredict:
        return repredict(out, args.repredict, cluster_doc, args)
    out.mkdir(parents=True, exist_ok=True)
    # timeout_s: a peer of a device killed for memory stops within it (the slowest plan's step
    # here, even DDP's 90 MB all-reduce over 100 Mbit/s, takes about 15 s)
    base = write_base(out, pad_size=args.pad_size, batch_size=args.batch_size, steps=args.steps, timeout_s=120,
                      **method_keys(None if args.method == "full" else args.method, args.lora_dim))
    use_cluster(args.cluster)
    t0 = time.time()
    model_path, devices_path = profile(out, base, world, [None] * world, args.repeats, args.profile_statistic)
    search = subprocess.run([sys.executable, "plan.py", "search", "--config_file", base, "--devices", devices_path,
                             "--model", model_path, "--out", str(out / "searched.json"), "--json",
                             str(out / "plans.json"), "--png", str(out / "searched.png"), "--top", "400"],
                            cwd=ROOT, env=env(), capture_output=True, text=True, check=True)
    print("\n".join(search.stdout.splitlines()[:8]), flush=True)
    print(f"profiles and search: {time.time() - t0:.0f} s", flush=True)
    ranked = json.loads((out / "plans.json").read_text())["plans"]
    layers = json.loads(Path(model_path).read_text())["hf_config"]["num_hidden_layers"]
    plans = candidates(ranked, world, layers, args, predictor(base, model_path, devices_path, world, args))
    alone_cluster, alone = one_device_cluster(cluster_doc, out)
    keys = {"pp_deg": 1, "dp_deg": 1}
    plans[f"{cluster_doc['devices'][alone]['name']} alone"] = {
        "keys": keys, "cluster": alone_cluster,
        **predictor(base, model_path, devices_path, 1, args, only=alone)(keys)}
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
    lines += accuracy(results) + memory_agreement(results)
    print("\n".join(lines), flush=True)
    (out / "results.json").write_text(json.dumps({"results": results, "args": vars(args), "world": world,
                                                  "summary": lines}, indent=1, default=str))
    chart(results, out / "plans.png", f"{Path(args.cluster).stem}, {args.method}")
    print(f"wrote {out / 'results.json'} and {out / 'plans.png'}")


if __name__ == "__main__":
    main()
