"""Memory budgets below what the even plan needs: the searched plan must fit when run, or the search
must say that none does.

all-MiniLM-L6-v2 at world 2 (one thread per rank, pinned with --pin). From the profiles (taken
here, or reused from bench/plan_accuracy.py with --profiles DIR), the Galaxy preset's even split
needs M MiB on rank 1 by the cost model; the budgets are rank 0: ample, rank 1: M - --cut MiB.
plan.py search writes its plan, pretrain_galaxy.py trains it, and every rank's measured peak RSS is
set against its budget. With --cut larger than any plan can save, search must exit 2 with one line.

With --peft METHOD (lora, adapter, side, side_only), a budget that decides: the profiles measure
the method too (taken here under the method's base config, or --profiles of a plan_accuracy.py
--peft run), and every rank gets the same budget, halfway between what the leanest plan needs
under full fine-tuning and under the method (each the least, over the plans the search finds, of
its fullest rank's need; --budget_mib sets it). plan.py search on the base config without the
method must exit 2 naming the ranks that are short; on the method's config it writes a plan, which
pretrain_galaxy.py trains, and every rank's measured peak is set against the budget.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/plan_memory.py --pin [--profiles runs/bench/plan_accuracy]
        [--cut 80] [--steps 6] [--out runs/bench/plan_memory]
    HF_HUB_OFFLINE=1 .venv/bin/python bench/plan_memory.py --pin --peft lora [--profiles runs/bench/plan_accuracy_lora]
        [--budget_mib M] [--out runs/bench/plan_memory_lora]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from plan_accuracy import PEFT_FLAGS, method_keys, method_of
from planning_runs import ROOT, env, profile, train, write_base

sys.path.insert(0, str(ROOT))

from galaxy.plan import Plan  # noqa: E402
from galaxy.planner.cost import CostModel  # noqa: E402
from galaxy.planner.profiles import load_devices, read_json  # noqa: E402
from galaxy.planner.search import search  # noqa: E402


def plan_search(base: str, devices_path: str, model_path: str, budgets, out: Path, name: str):
    """plan.py search as a user runs it: (the finished process, the written config's path)."""
    planned = out / f"{name}.json"
    run = subprocess.run([sys.executable, "plan.py", "search", "--config_file", base, "--devices", devices_path,
                          "--model", model_path, "--memory_mib", *map(str, budgets), "--out", str(planned),
                          "--json", str(out / f"{name}.plans.json")], cwd=ROOT, env=env(), capture_output=True, text=True)
    print(run.stdout + run.stderr)
    return run, planned


def train_planned(out: Path, base: str, planned: Path, cores) -> tuple[dict, dict, dict]:
    """Train what the search wrote: (its keys over the base, what the search predicted, what the
    run measured)."""
    cfg = json.loads(planned.read_text())
    keys = {k: v for k, v in cfg.items() if k not in json.loads(Path(base).read_text()) and k != "_planned"}
    return keys, cfg["_planned"], train(out, base, f"{planned.stem}_run", keys, 2, cores)


def leanest_need(cost: CostModel) -> float:
    """About the least budget (MiB, every rank alike) under which some plan fits: the search's plans
    bisected over the budget (to 1 MiB)."""
    lo, hi = 0.0, 2.0 * max(cost.estimate_memory(Plan(heads=(12,), columns=(1536,), tokens=(cost.seq,),
                                                      stages=(cost.layers,), checkpoint=())))
    while hi - lo > 1.0:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if search(cost, [mid] * cost.world, top=1).ranked else (mid, hi)
    return hi


def full_or_even(args, out: Path, base: str, model_path: str, devices_path: str, cores) -> None:
    """The budgets below the even Galaxy split's need (the bench's first question)."""
    model = read_json(model_path)
    devices, link = load_devices(devices_path)
    s = args.pad_size
    even = Plan(heads=(6, 6), columns=(768, 768), tokens=(s // 2, s - s // 2), stages=(6,), checkpoint=())
    need = CostModel(model, devices, link, batch_size=args.batch_size).estimate(even).memory_mib
    budgets = [max(need) * 4, need[1] - args.cut]
    run, planned = plan_search(base, devices_path, model_path, budgets, out, "planned")
    print(f"even Galaxy split needs {need[0]:.0f}, {need[1]:.0f} MiB (predicted); budgets {budgets[0]:.0f}, "
          f"{budgets[1]:.0f} MiB")
    if run.returncode == 2:
        print("search: no plan fits (exit 2, the line above)")
        return
    run.check_returncode()
    keys, predicted, got = train_planned(out, base, planned, cores)
    fits = all(m <= b for m, b in zip(got["peak_mib"], budgets))
    print(f"planned: predicted {predicted['predicted_memory_mib']} MiB, measured peak "
          f"{got['peak_mib']} MiB, budgets {[round(b) for b in budgets]}: {'fits' if fits else 'DOES NOT FIT'}")
    (out / "results.json").write_text(json.dumps({"need_even": need, "budgets": budgets, "planned": keys,
                                                   "predicted": predicted, "measured": got, "fits": fits},
                                                  indent=1))


def deciding_budget(args, out: Path, base: str, model_path: str, devices_path: str, cores) -> None:
    """A budget under which full fine-tuning fits no plan and the method does (module docstring)."""
    model = read_json(model_path)
    devices, link = load_devices(devices_path)
    method = method_of(base, model)
    need = {name: leanest_need(CostModel(model, devices, link, batch_size=args.batch_size, method=m))
            for name, m in (("full", None), (args.peft, method))}
    budget = args.budget_mib or (need["full"] + need[args.peft]) / 2
    print(f"the leanest plan's fullest rank needs {need['full']:.0f} MiB under full fine-tuning, "
          f"{need[args.peft]:.0f} MiB under {args.peft} (predicted); budget {budget:.0f} MiB per rank")
    full_base = out / "base_full.json"
    full_base.write_text(json.dumps({k: v for k, v in json.loads(Path(base).read_text()).items()
                                     if k not in method_keys(args.peft, args.lora_dim)}, indent=1))
    full_run, _ = plan_search(str(full_base), devices_path, model_path, [budget, budget], out, "planned_full")
    run, planned = plan_search(base, devices_path, model_path, [budget, budget], out, "planned")
    result = {"need": need, "budget_mib": budget, "full_exit": full_run.returncode,
              "full_error": full_run.stderr.strip(), "method_exit": run.returncode}
    if run.returncode == 0:
        keys, predicted, got = train_planned(out, base, planned, cores)
        fits = all(m <= budget for m in got["peak_mib"])
        result.update(planned=keys, predicted=predicted, measured=got, fits=fits)
        print(f"{args.peft} plan: predicted {predicted['predicted_memory_mib']} MiB, measured peak "
              f"{got['peak_mib']} MiB, budget {budget:.0f}: {'fits' if fits else 'DOES NOT FIT'}")
    decides = full_run.returncode == 2 and run.returncode == 0 and result.get("fits", False)
    print(f"full fine-tuning: exit {full_run.returncode} (want 2); {args.peft}: exit {run.returncode} (want 0) "
          f"-> the budget {'decides' if decides else 'DOES NOT decide'}")
    result["decides"] = decides
    (out / "results.json").write_text(json.dumps(result, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pad_size", type=int, default=64)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--cut", type=float, default=80.0, help="MiB below the even plan's need on rank 1")
    p.add_argument("--pin", action="store_true")
    p.add_argument("--profiles", help="a folder holding model.json and devices.json of the same settings")
    p.add_argument("--peft", choices=sorted(PEFT_FLAGS), help="a budget under which this method fits and full "
                                                              "fine-tuning does not")
    p.add_argument("--lora_dim", type=int, default=8)
    p.add_argument("--budget_mib", type=float, help="--peft: the budget per rank (default: halfway)")
    p.add_argument("--out", help="default: runs/bench/plan_memory[_METHOD]")
    args = p.parse_args()
    out = ROOT / (args.out or "runs/bench/plan_memory" + (f"_{args.peft}" if args.peft else ""))
    cores = [0, 1] if args.pin else [None, None]
    base = write_base(out, pad_size=args.pad_size, batch_size=args.batch_size, steps=args.steps,
                      **method_keys(args.peft, args.lora_dim))
    if args.profiles:
        model_path, devices_path = str(ROOT / args.profiles / "model.json"), str(ROOT / args.profiles / "devices.json")
    else:
        model_path, devices_path = profile(out, base, 2, cores)
    (deciding_budget if args.peft else full_or_even)(args, out, base, model_path, devices_path, cores)


if __name__ == "__main__":
    main()
