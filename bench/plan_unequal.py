"""Unequal devices made with real contention: the searched plan against the even split and a grid.

Two ranks on two cores: rank 0 pinned alone on core 0, rank 1 pinned on core 1 beside a CPU-bound
process of equal priority (`while True: pass`, pinned there too), so rank 1 gets about half of
its core: a 1 : 0.5 pair. Under that contention (kept for the whole run):

  1. plan.py profile-model, profile-devices (both ranks, pinned) and plan.py search (ample memory)
  2. the searched plan trains --steps steps under pretrain_galaxy.py, and so does the even split of
     its preset, and a brute-force grid of share choices of that preset. A Galaxy group of both
     ranks: the even split has the same methods, the grid is rank 0's heads (--heads) x rank 0's
     fraction of the MLP columns and tokens (--fractions), or under ATT SP, where heads are no
     choice, every token split from even to 0.85 to rank 0. A two-stage pipeline: the even split
     has half the layers on each stage and the same micro-batches, the grid is rank 0's layers
     (1 to L - 1) x the micro-batches (--microbatches). --mesh group or pipeline keeps the search
     to that preset (plan.py search --pp / --dp); any (default) takes whichever it finds fastest

and prints every measured step time (--statistic of the steps after the first), the searched plan's
speed-up over the even split (target >= 1.3x) and its distance from the grid's best (target <= 5%).
The searched plan and the even split train --rounds times each, alternating, and each counts its
least disturbed run (the smallest of the runs' statistics: whole runs on a shared host slow down
by up to 40% at times). A grid point trains once, so the grid's best of 20 single runs is flattered
by its own noise (the smallest of many noisy figures sits below the mean of the plan it picks):
the grid only selects. Its --final_top best points and the searched plan then train --final_rounds
more times, alternating, and searched / best is also printed from those runs alone (the same
count of runs for each, in the same minutes).

    HF_HUB_OFFLINE=1 .venv/bin/python bench/plan_unequal.py [--mesh any|group|pipeline] [--steps 6] [--rounds 3]
        [--heads 6 7 8 9 10] [--fractions 0.5 0.6 0.667 0.75] [--microbatches 1 2 4 8]
        [--statistic median] [--profile_statistic median]
        [--final_top 3] [--final_rounds 3]
        [--out runs/bench/plan_unequal]

needs taskset (util-linux) and at least two cores.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from planning_runs import MODEL, ROOT, env, pin, profile, train, write_base

from galaxy.models.shape import read_model_shape

CORES = [0, 1]


def start_competitor() -> subprocess.Popen:
    """A CPU-bound process of equal priority pinned on rank 1's core."""
    return subprocess.Popen([*pin(1), sys.executable, "-c", "while True: pass"], env=env())


SP_MAX_FRACTION = 0.85


def shares_for(heads0: int | None, fraction: float, heads: int, columns: int, seq: int) -> dict:
    heads0 = heads // 2 if heads0 is None else heads0
    c0, t0 = round(columns * fraction), round(seq * fraction)
    return {"tp_num_attention_heads_list": [heads0, heads - heads0], "tp_intermediate_size_list": [c0, columns - c0],
            "seq_scatter_list": [t0, seq - t0]}


def grid_name(heads0: int | None, fraction: float, heads: int) -> str:
    return f"grid frac {fraction:.3f}" if heads0 is None else f"grid heads {heads0}:{heads - heads0} frac {fraction:.3f}"


MESH_FLAGS = {"any": [], "group": ["--pp", "1", "--dp", "1"], "pipeline": ["--pp", "2", "--dp", "1"]}
PIPELINE_KEYS = ("stage_num_hidden_layers_list", "num_microbatches", "pipeline_schedule")


def stage_keys(first: int, layers: int, micro: int) -> dict:
    """A two-stage pipeline with `first` layers on rank 0 (the schedule as plan.py search picks it:
    1f1b once there are as many micro-batches as stages)."""
    return {"pp_deg": 2, "dp_deg": 1, "stage_num_hidden_layers_list": [first, layers - first],
            "num_microbatches": micro, "pipeline_schedule": "1f1b" if micro >= 2 else "gpipe"}


def grid_points(att: str, heads: list[int], fractions: list[float], seq: int) -> list[tuple[int | None, float]]:
    """(rank 0's heads or None, rank 0's fraction of columns and tokens): the share choices that are
    distinct plans under the searched methods. With ATT SP the heads are no choice (every rank runs
    them all), so the grid spans every token split from even to SP_MAX_FRACTION instead: 23 choices
    at pad 64, where heads x fractions would repeat 4 plans 5 times."""
    if att == "SP":
        return [(None, t / seq) for t in range(seq // 2, round(seq * SP_MAX_FRACTION) + 1)]
    return [(h, f) for h in heads for f in fractions]


def preset_plans(cfg: dict, keys: dict, args, shape: dict) -> tuple[str, dict, dict[str, dict]]:
    """(the searched plan's preset, its even split's keys, {grid point name: keys}) for a Galaxy
    group of both ranks or a two-stage pipeline; exits for a plan with no share choice to grid."""
    layers = shape["num_hidden_layers"]
    if cfg.get("pp_deg", 1) == 2 and cfg.get("dp_deg", 1) == 1:
        base = {k: v for k, v in keys.items() if k not in ("tp_num_attention_heads_list", "tp_intermediate_size_list",
                                                            "seq_scatter_list", "activation_checkpointing")}
        even = {**base, **stage_keys(layers // 2, layers, cfg["num_microbatches"])}
        grid = {f"grid stages {a}:{layers - a} micro {m}": {**base, **stage_keys(a, layers, m)}
                for a in range(1, layers) for m in args.microbatches if args.batch_size % m == 0}
        return "two-stage pipeline", even, grid
    if cfg.get("pp_deg", 1) != 1 or cfg.get("dp_deg", 1) != 1:
        sys.exit(f"the search chose pp {cfg.get('pp_deg')} x dp {cfg.get('dp_deg')}, which has no share choice to "
                 f"grid here; run with --mesh group or --mesh pipeline")
    heads, columns = shape["num_attention_heads"], shape["intermediate_size"]
    methods = {k: cfg[k] for k in ("att_parallel_method", "mlp_parallel_method", "con_parallel_method")}
    even = dict(keys, pp_deg=1, dp_deg=1, **shares_for(heads // 2, 0.5, heads, columns, args.pad_size), **methods)
    for k in (*PIPELINE_KEYS, "grad_accum_steps"):
        even.pop(k, None)
    grid = {grid_name(h0, f, heads): {**even, **shares_for(h0, f, heads, columns, args.pad_size)}
            for h0, f in grid_points(methods["att_parallel_method"], args.heads, args.fractions, args.pad_size)}
    return "Galaxy group, ATT {att_parallel_method} MLP {mlp_parallel_method} CON {con_parallel_method}".format(
        **methods), even, grid


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pad_size", type=int, default=64)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--heads", type=int, nargs="+", default=[6, 7, 8, 9, 10], help="rank 0's heads in the grid")
    p.add_argument("--fractions", type=float, nargs="+", default=[0.5, 0.6, 0.667, 0.75],
                   help="rank 0's fraction of columns and tokens in the grid")
    p.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8],
                   help="micro-batches in the grid when the searched plan is a pipeline")
    p.add_argument("--mesh", choices=tuple(MESH_FLAGS), default="any",
                   help="keep the search to a Galaxy group of both ranks or a two-stage pipeline (default: either)")
    p.add_argument("--statistic", choices=("median", "min"), default="median", help="of a run's steps")
    p.add_argument("--profile_statistic", choices=("median", "min", "mean"), default="median",
                   help="profile-devices --statistic (mean suits rank 1, which shares its core while it trains "
                        "too; median keeps the runs comparable with the earlier runs in bench/results/plan_unequal.md)")
    p.add_argument("--rounds", type=int, default=3, help="runs of the searched plan and of the even split, alternating")
    p.add_argument("--repeats", type=int, default=3, help="profile-devices --repeats")
    p.add_argument("--final_top", type=int, default=3, help="grid points re-measured beside the searched plan")
    p.add_argument("--final_rounds", type=int, default=3, help="rounds of that re-measurement (0: none)")
    p.add_argument("--out", default="runs/bench/plan_unequal")
    args = p.parse_args()
    if (os.cpu_count() or 1) < 2:
        sys.exit("plan_unequal.py needs two cores")
    out = ROOT / args.out
    base = write_base(out, pad_size=args.pad_size, batch_size=args.batch_size, steps=args.steps)
    competitor = start_competitor()
    try:
        t0 = time.time()
        model_path, devices_path = profile(out, base, 2, CORES, args.repeats, args.profile_statistic)
        planned = out / "planned.json"
        search = subprocess.run([sys.executable, "plan.py", "search", "--config_file", base, "--devices", devices_path,
                                 "--model", model_path, "--out", str(planned), "--png", str(out / "plan.png"),
                                 *MESH_FLAGS[args.mesh]],
                                cwd=ROOT, env=env(), capture_output=True, text=True, check=True)
        print(search.stdout, flush=True)
        print(f"profiles and search: {time.time() - t0:.0f} s", flush=True)
        cfg = json.loads(planned.read_text())
        keys = {k: v for k, v in cfg.items() if k not in json.loads(Path(base).read_text()) and k != "_planned"}
        preset, even_keys, grid_plans = preset_plans(cfg, keys, args, read_model_shape(MODEL))
        print(f"searched preset: {preset}; {len(grid_plans)} share choices in the grid", flush=True)
        results = {}

        def measure(name, keys):
            got = train(out, base, name, keys, 2, CORES, args.statistic)
            results.setdefault(name, {"keys": keys, "runs": []})["runs"].append(got)
            print(f"{name:<34} {got['step_s'] * 1e3:8.1f} ms   {json.dumps(keys)[:110]}", flush=True)
            return got["step_s"]

        runs = [(measure("searched", keys), measure("even split, same preset", even_keys))
                for _ in range(args.rounds)]
        searched, even = min(r[0] for r in runs), min(r[1] for r in runs)
        grid = {name: measure(name, point) for name, point in grid_plans.items()}
        top = sorted(grid, key=grid.get)[: args.final_top]
        finalists = {"searched": keys} | {name: grid_plans[name] for name in top}
        final = {name: [] for name in finalists}
        for r in range(args.final_rounds):
            for name in (list(finalists) if r % 2 == 0 else list(finalists)[::-1]):
                final[name].append(measure(name, finalists[name]))
    finally:
        competitor.kill()
        competitor.wait()
    best_name = min(grid, key=grid.get)
    best = grid[best_name]
    print(f"\nsearched {searched * 1e3:.1f} ms, even split {even * 1e3:.1f} ms: speed-up {even / searched:.2f}x "
          f"(target >= 1.3x); grid of {len(grid)}: best {best * 1e3:.1f} ms at {best_name[5:]}; "
          f"searched / best {searched / best:.3f} (target <= 1.05)")
    final_ratio = None
    if args.final_rounds and top:      # each finalist's least disturbed re-run
        least = {name: min(runs) for name, runs in final.items()}
        rival = min((n for n in least if n != "searched"), key=least.get)
        final_ratio = least["searched"] / least[rival]
        print(f"re-measured {args.final_rounds}x each, alternating: searched {least['searched'] * 1e3:.1f} ms, "
              + ", ".join(f"{n} {t * 1e3:.1f} ms" for n, t in least.items() if n != "searched")
              + f"; searched / best {final_ratio:.3f} (target <= 1.05)")
    (out / "results.json").write_text(json.dumps({"results": {k: v for k, v in results.items()},
                                                   "speedup_over_even": even / searched,
                                                   "searched_over_grid_best": searched / best,
                                                   "searched_over_best_remeasured": final_ratio,
                                                   "preset": preset,
                                                   "args": vars(args)}, indent=1, default=str))
    print(f"wrote {out / 'results.json'}")


if __name__ == "__main__":
    main()
