"""The planner's cost model against measured runs: predicted vs measured step time and peak memory.

all-MiniLM-L6-v2, world 2 on this machine (gloo over loopback, one thread per rank, each rank
pinned to its own core with --pin). plan.py profile-model and profile-devices (2 ranks, pinned as
training) take the profiles once; then every plan below trains --steps AdamW steps under
pretrain_galaxy.py as users run it (serial runs one process), --rounds times: each round runs every
plan once, in alternating order (forward, then backward), so that a slow spell of the machine falls
on several plans instead of all of one plan's steps. A plan's step time is its least disturbed run's:
the smallest over rounds of each run's median step (steps after the first, from metrics_file; the
host this bench was written on slows whole runs by up to 40% at times, as timeit's advice has it,
the slower runs measure the neighbours, not the plan); its peak RSS per rank the median of the
runs' "done" events. Both are set against galaxy.planner.cost's prediction from the profiles:

  serial, TP, SP, Galaxy (even and uneven shares), TP and SP uneven, the four mixed ATT/MLP x CON
  combinations, pp 2 (even stages, 2 micro-batches; uneven stages, 4), dp 2, dp 2 with 2
  accumulation steps, Galaxy with every layer recomputed

With --peft METHOD (lora, adapter, side, side_only) the base config trains that method (LoRA:
--lora_dim, the family's targets), the profiles measure it too, and the predictions are the cost
model's for it; under side-tuning the recomputed plan is left out (recomputation does nothing
where no backward runs through the backbone).

Prints the table, the Spearman rank correlation of predicted vs measured step time, the median
absolute error of step time and of peak memory (every rank), writes JSON and a predicted-vs-measured
chart.

With --cluster FILE every run (profile-devices included) starts through `python -m galaxy.edge
run`: one rank per emulated device, its link shaped and its CPU share and memory held by cgroups
(the testbed's cgroup outweighs everything else on the host, so other work on it disturbs the
timings less than it does pinned processes on loopback); serial runs take the first device.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/plan_accuracy.py [--pin] [--steps 6] [--rounds 3]
        [--pad_size 64] [--batch_size 8] [--only N] [--peft lora] [--cluster clusters/two_equal_1g.json]
        [--out runs/bench/plan_accuracy]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from planning_runs import ROOT, profile, spearman, train, use_cluster, write_base

sys.path.insert(0, str(ROOT))

from galaxy.config import load_config  # noqa: E402
from galaxy.models.registry import family_of  # noqa: E402
from galaxy.plan import Plan  # noqa: E402
from galaxy.planner.cost import CostModel  # noqa: E402
from galaxy.planner.method import config_signature  # noqa: E402
from galaxy.planner.model_profile import check_method  # noqa: E402
from galaxy.planner.profiles import load_devices, read_json  # noqa: E402

PEFT_FLAGS = {"lora": "use_lora", "adapter": "use_adapter", "side": "use_side", "side_only": "use_side_only"}


def method_keys(method: str | None, lora_dim: int) -> dict:
    """The base config's keys for a PEFT method (none: full fine-tuning)."""
    if method is None:
        return {}
    return {PEFT_FLAGS[method]: True, **({"lora_dim": lora_dim, "lora_alpha": 2 * lora_dim} if method == "lora" else {})}


def method_of(base: str, model: dict) -> dict | None:
    """The signature of the base config's method (None: full), checked against the model profile."""
    signature = config_signature(load_config(base), family_of(model["model_type"]))
    return signature if check_method(model, signature, "model.json") else None


def plans(pad: int) -> list[tuple[str, int, Plan]]:
    """(name, world, plan) on MiniLM: 12 heads, 1536 columns, 6 layers, pad tokens."""
    h, c, s = 12, 1536, pad
    third = (2 * s // 3, s - 2 * s // 3)
    g = lambda a, m, n, heads=(6, 6), cols=(768, 768), tok=(s // 2, s - s // 2), **kw: \
        Plan(a, m, n, heads=heads, columns=cols, tokens=tok, stages=(6,), **kw)          # noqa: E731
    whole = dict(heads=(h,), columns=(c,), tokens=(s,))
    return [
        ("serial", 1, Plan(stages=(6,), checkpoint=(), **whole)),
        ("TP even", 2, g("TP", "TP", "None")),
        ("SP even", 2, g("SP", "SP", "SP")),
        ("Galaxy even", 2, g("TP", "TP", "SP")),
        ("Galaxy uneven 2:1", 2, g("TP", "TP", "SP", (8, 4), (1024, 512), third)),
        ("TP uneven 3:1", 2, g("TP", "TP", "None", (9, 3), (1152, 384))),
        ("SP uneven", 2, g("SP", "SP", "SP", tok=(s * 11 // 16, s - s * 11 // 16))),
        ("ATT TP MLP SP CON SP", 2, g("TP", "SP", "SP")),
        ("ATT SP MLP TP CON SP", 2, g("SP", "TP", "SP")),
        ("ATT TP MLP SP CON None", 2, g("TP", "SP", "None")),
        ("ATT SP MLP TP CON None", 2, g("SP", "TP", "None")),
        ("pp 2, 2 micro-batches", 2, Plan(pp=2, stages=(3, 3), microbatches=2, checkpoint=(), **whole)),
        ("pp 2 uneven, 4 micro", 2, Plan(pp=2, stages=(4, 2), microbatches=4, checkpoint=(), **whole)),
        ("dp 2", 2, Plan(dp=2, stages=(6,), checkpoint=(), **whole)),
        ("dp 2, accumulation 2", 2, Plan(dp=2, stages=(6,), microbatches=2, checkpoint=(), **whole)),
        ("Galaxy, all recomputed", 2, g("TP", "TP", "SP", checkpoint=tuple(range(6)))),
    ]


def chart(rows, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(11, 5))
    FigureCanvasAgg(fig)
    a, b = fig.subplots(1, 2)
    pred = [r["predicted_s"] * 1e3 for r in rows]
    meas = [r["measured_s"] * 1e3 for r in rows]
    a.scatter(meas, pred)
    for r, x, y in zip(rows, meas, pred):
        a.annotate(r["name"], (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    top = max(pred + meas) * 1.1
    a.plot([0, top], [0, top], color="grey", lw=0.8)
    a.set_xlabel("measured step ms")
    a.set_ylabel("predicted step ms")
    a.set_title("step time")
    pm = [m for r in rows for m in r["predicted_mib"]]
    mm = [m for r in rows for m in r["measured_mib"]]
    b.scatter(mm, pm, color="#dd8452")
    lo, hi = min(pm + mm) * 0.9, max(pm + mm) * 1.1
    b.plot([lo, hi], [lo, hi], color="grey", lw=0.8)
    b.set_xlabel("measured peak MiB (RSS)")
    b.set_ylabel("predicted peak MiB")
    b.set_title("peak memory per rank")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pad_size", type=int, default=64)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--pin", action="store_true", help="pin rank r to core r (taskset)")
    p.add_argument("--rounds", type=int, default=3,
                   help="each plan is trained once per round; rounds alternate the order of the plans")
    p.add_argument("--only", type=int, help="run only the first N plans")
    p.add_argument("--repeats", type=int, default=3, help="profile-devices --repeats")
    p.add_argument("--statistic", choices=("median", "min"), default="median",
                   help="of profile rounds and of measured steps alike: min on a machine shared with other work")
    p.add_argument("--peft", choices=sorted(PEFT_FLAGS), help="train and cost this PEFT method (default: full)")
    p.add_argument("--lora_dim", type=int, default=8)
    p.add_argument("--cluster", help="profile and train on the edge testbed's cluster FILE (two devices; serial "
                                     "runs on its first)")
    p.add_argument("--out", help="default: runs/bench/plan_accuracy[_METHOD]")
    args = p.parse_args()
    use_cluster(args.cluster)
    out = ROOT / (args.out or "runs/bench/plan_accuracy" + (f"_{args.peft}" if args.peft else ""))
    cores = [0, 1] if args.pin else [None, None]
    base = write_base(out, pad_size=args.pad_size, batch_size=args.batch_size, steps=args.steps,
                      **method_keys(args.peft, args.lora_dim))
    t0 = time.time()
    model_path, devices_path = profile(out, base, 2, cores, args.repeats, args.statistic)
    print(f"profiles taken in {time.time() - t0:.0f} s", flush=True)
    model = read_json(model_path)
    devices, link = load_devices(devices_path)
    method = method_of(base, model)
    cost = {1: CostModel(model, devices[:1], None, batch_size=args.batch_size, method=method),
            2: CostModel(model, devices, link, batch_size=args.batch_size, method=method)}
    chosen = [c for c in plans(args.pad_size) if not (args.peft in ("side", "side_only") and c[2].recomputed)]
    chosen = chosen[: args.only]
    runs: list[list[dict]] = [[] for _ in chosen]
    for r in range(args.rounds):
        order = range(len(chosen)) if r % 2 == 0 else reversed(range(len(chosen)))
        for i in order:
            name, world, plan = chosen[i]
            runs[i].append(train(out, base, f"plan{i:02d}", plan.to_keys(6), world, cores[:world],
                                 args.statistic))
        print(f"round {r + 1} of {args.rounds} done", flush=True)
    rows = []
    print(f"{'plan':<26} {'pred ms':>8} {'meas ms':>8} {'err':>7} | {'pred MiB':>13} {'meas MiB':>13} {'err':>13}")
    for (name, world, plan), got in zip(chosen, runs):
        est = cost[world].estimate(plan)
        measured = min(g["step_s"] for g in got)
        peak = [statistics.median(g["peak_mib"][k] for g in got) for k in range(world)]
        row = {"name": name, "world": world, "predicted_s": est.step_s, "measured_s": measured,
               "round_step_s": [g["step_s"] for g in got], "step_times": [g["step_times"] for g in got],
               "predicted_mib": [round(m, 1) for m in est.memory_mib], "measured_mib": peak,
               "keys": plan.to_keys(6)}
        rows.append(row)
        err = est.step_s / measured - 1
        merr = [pm / mm - 1 for pm, mm in zip(row["predicted_mib"], row["measured_mib"])]
        each = " ".join(f"{t * 1e3:.0f}" for t in row["round_step_s"])
        print(f"{name:<26} {est.step_s * 1e3:>8.1f} {measured * 1e3:>8.1f} {err:>+7.1%} | "
              f"{','.join(f'{m:.0f}' for m in row['predicted_mib']):>13} "
              f"{','.join(f'{m:.0f}' for m in row['measured_mib']):>13} "
              f"{','.join(f'{e:+.1%}' for e in merr):>13}   rounds {each}", flush=True)
    rho = spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows])
    time_err = statistics.median(abs(r["predicted_s"] / r["measured_s"] - 1) for r in rows)
    mem_err = [abs(pm / mm - 1) for r in rows for pm, mm in zip(r["predicted_mib"], r["measured_mib"])]
    print(f"\n{args.peft or 'full fine-tuning'}, {len(rows)} plans: Spearman {rho:.3f} (target >= 0.9); median |step time error| {time_err:.1%} "
          f"(target <= 15%); peak memory per rank: median |error| {statistics.median(mem_err):.1%}, "
          f"max {max(mem_err):.1%}, within 10% for {sum(e <= 0.10 for e in mem_err)} of {len(mem_err)} ranks")
    (out / "results.json").write_text(json.dumps({"rows": rows, "spearman": rho, "median_abs_time_error": time_err,
                                                   "memory_abs_errors": mem_err, "args": vars(args)}, indent=1))
    chart(rows, out / "plan_accuracy.png")
    print(f"wrote {out / 'results.json'} and {out / 'plan_accuracy.png'}")


if __name__ == "__main__":
    main()
