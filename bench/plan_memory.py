"""Memory budgets below what the even plan needs: the searched plan must fit when run, or the search
must say that none does.

all-MiniLM-L6-v2 at world 2 (one thread per rank, pinned with --pin). From the profiles (taken
here, or reused from bench/plan_accuracy.py with --profiles DIR), the Galaxy preset's even split
needs M MiB on rank 1 by the cost model; the budgets are rank 0: ample, rank 1: M - --cut MiB.
plan.py search writes its plan, pretrain_galaxy.py trains it, and every rank's measured peak RSS is
set against its budget. With --cut larger than any plan can save, search must exit 2 with one line.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/plan_memory.py --pin [--profiles runs/bench/plan_accuracy]
        [--cut 80] [--steps 6] [--out runs/bench/plan_memory]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from planning_runs import ROOT, env, profile, train, write_base

sys.path.insert(0, str(ROOT))

from galaxy.plan import Plan  # noqa: E402
from galaxy.planner.cost import CostModel  # noqa: E402
from galaxy.planner.profiles import load_devices, read_json  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pad_size", type=int, default=64)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--cut", type=float, default=80.0, help="MiB below the even plan's need on rank 1")
    p.add_argument("--pin", action="store_true")
    p.add_argument("--profiles", help="a folder holding model.json and devices.json of the same settings")
    p.add_argument("--out", default="runs/bench/plan_memory")
    args = p.parse_args()
    out = ROOT / args.out
    cores = [0, 1] if args.pin else [None, None]
    base = write_base(out, pad_size=args.pad_size, batch_size=args.batch_size, steps=args.steps)
    if args.profiles:
        model_path, devices_path = str(ROOT / args.profiles / "model.json"), str(ROOT / args.profiles / "devices.json")
    else:
        model_path, devices_path = profile(out, base, 2, cores)
    model = read_json(model_path)
    devices, link = load_devices(devices_path)
    s = args.pad_size
    even = Plan(heads=(6, 6), columns=(768, 768), tokens=(s // 2, s - s // 2), stages=(6,), checkpoint=())
    need = CostModel(model, devices, link, batch_size=args.batch_size).estimate(even).memory_mib
    budgets = [max(need) * 4, need[1] - args.cut]
    planned = out / "planned.json"
    run = subprocess.run([sys.executable, "plan.py", "search", "--config_file", base, "--devices", devices_path,
                          "--model", model_path, "--memory_mib", *map(str, budgets), "--out", str(planned)],
                         cwd=ROOT, env=env(), capture_output=True, text=True)
    print(run.stdout + run.stderr)
    print(f"even Galaxy split needs {need[0]:.0f}, {need[1]:.0f} MiB (predicted); budgets {budgets[0]:.0f}, "
          f"{budgets[1]:.0f} MiB")
    if run.returncode == 2:
        print("search: no plan fits (exit 2, the line above)")
        return
    run.check_returncode()
    cfg = json.loads(planned.read_text())
    keys = {k: v for k, v in cfg.items() if k not in json.loads(Path(base).read_text()) and k != "_planned"}
    got = train(out, base, "planned", keys, 2, cores)
    fits = all(m <= b for m, b in zip(got["peak_mib"], budgets))
    print(f"planned: predicted {cfg['_planned']['predicted_memory_mib']} MiB, measured peak "
          f"{got['peak_mib']} MiB, budgets {[round(b) for b in budgets]}: {'fits' if fits else 'DOES NOT FIT'}")
    (out / "results.json").write_text(json.dumps({"need_even": need, "budgets": budgets, "planned": keys,
                                                   "predicted": cfg["_planned"], "measured": got, "fits": fits},
                                                  indent=1))


if __name__ == "__main__":
    main()
