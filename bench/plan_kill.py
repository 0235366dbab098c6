"""A plan too big for a device: the search's budget refuses it, the testbed kills it, the searched plan trains.

Issue 30's memory case, on an emulated cluster (the edge testbed: one rank per device, its CPU
share, memory limit and shaped link), all-MiniLM-L6-v2 classification, full fine-tuning, at a
batch where even DDP holds more than the smallest device has:

  1. plan.py profile-model (host) and profile-devices (inside the testbed, at --profile_batch:
     the compute table is per token, so a smaller batch measures the same devices while the
     profile itself stays within the smallest device's limit), then plan.py search at
     --batch_size with --json;
  2. even DDP costed by the search's own model: its predicted peak per device against the
     search's budgets (each device's limit less the headroom): over budget on a device means the
     search never offers it;
  3. even DDP trains anyway: the testbed reports the device the kernel killed for memory, and its
     peers stop within timeout_s;
  4. the searched plan trains: its measured peak per device (the memory cgroup's) against the
     budget and the prediction.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/plan_kill.py --cluster clusters/home3.json
        [--batch_size 24] [--profile_batch 12] [--pad_size 128] [--steps 3]
        [--devices DEVICES_JSON] [--out runs/bench/plan_kill_home3] [--json F]

--devices reuses a profile taken on the same cluster (plan_cluster.py's devices.json) instead of
taking one. Needs root (the testbed).
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from plan_cluster import describe, predictor, run_on
from planning_runs import ROOT, env, profile, use_cluster, write_base


def budgets(devices_path: str, headroom: float) -> list[float]:
    """The search's memory budget per device (MiB): its limit less the headroom."""
    devices = json.loads(Path(devices_path).read_text())["devices"]
    return [d["memory_mib"] * (1 - headroom / 100) for d in devices]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cluster", required=True)
    p.add_argument("--batch_size", type=int, default=24, help="divisible by the devices (even DDP)")
    p.add_argument("--profile_batch", type=int, default=12)
    p.add_argument("--pad_size", type=int, default=128)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--headroom", type=float, default=5.0, help="plan.py search --headroom (percent)")
    p.add_argument("--devices", help="a devices profile taken on this cluster (skip profile-devices)")
    p.add_argument("--timeout", type=float, default=600, help="seconds a run may take")
    p.add_argument("--out")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    names = [d["name"] for d in json.loads(Path(args.cluster).read_text())["devices"]]
    world = len(names)
    out = ROOT / (args.out or f"runs/bench/plan_kill_{Path(args.cluster).stem}")
    use_cluster(args.cluster)
    # A peer of a killed device stops within timeout_s: even DDP's 90 MB all-reduce over a
    # 100 Mbit/s link takes about 15 s a step.
    profile_base = write_base(out / "profile", pad_size=args.pad_size, batch_size=args.profile_batch,
                              steps=args.steps, timeout_s=120)
    base = write_base(out, pad_size=args.pad_size, batch_size=args.batch_size, steps=args.steps, timeout_s=120)
    if args.devices:
        model_path, devices_path = str(out / "model.json"), str(out / "devices.json")
        shutil.copy(args.devices, devices_path)
        subprocess.run([sys.executable, "plan.py", "profile-model", "--config_file", base, "--out", model_path],
                       cwd=ROOT, env=env(), check=True, capture_output=True)
    else:
        model_path, devices_path = profile(out, profile_base, world, [None] * world, 3, "mean")
    search = subprocess.run([sys.executable, "plan.py", "search", "--config_file", base, "--devices", devices_path,
                             "--model", model_path, "--out", str(out / "searched.json"), "--json",
                             str(out / "plans.json"), "--headroom", str(args.headroom)],
                            cwd=ROOT, env=env(), capture_output=True, text=True, check=True)
    print("\n".join(search.stdout.splitlines()[:5]), flush=True)
    searched = json.loads((out / "plans.json").read_text())["plans"][0]
    even_ddp = {"pp_deg": 1, "dp_deg": world}
    guess = predictor(base, model_path, devices_path, world, args)(even_ddp)
    limit = budgets(devices_path, args.headroom)
    over = [r for r, (m, b) in enumerate(zip(guess["predicted_memory_mib"], limit)) if m > b]
    results = {"devices": names, "budget_mib": [round(b, 1) for b in limit],
               "even DDP": {"keys": even_ddp, **guess, "over_budget_ranks": over,
                            "run": run_on(args.cluster, out, base, "even DDP", even_ddp, args.timeout)},
               "searched": {**searched, "run": run_on(args.cluster, out, base, "searched", searched["keys"],
                                                      args.timeout)}}
    print(report(results))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **results}, indent=1))


def report(results: dict) -> str:
    limit = results["budget_mib"]
    lines = ["budgets (MiB): " + ", ".join(f"{n} {b:.0f}" for n, b in zip(results["devices"], limit))]
    for name in ("even DDP", "searched"):
        r = results[name]
        run = r["run"]
        lines.append(f"{name:<9} {describe(r['keys'])[:60]:<60}")
        lines.append(f"  predicted peak MiB {r['predicted_memory_mib']} (step {r['predicted_step_s'] * 1e3:.0f} ms)")
        if name == "even DDP":
            lines.append("  over the budget on " + (", ".join(results["devices"][i] for i in r["over_budget_ranks"]) or "none")
                         + ": the search " + ("never offers it" if r["over_budget_ranks"] else "could offer it"))
        measured = f"{run['step_s'] * 1e3:.0f} ms a step" if "step_s" in run else "no step time"
        lines.append(f"  ran: {run['status']}; {measured}; measured peak MiB {run['peak_mib']}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
