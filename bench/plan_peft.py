"""The choice changes for the right reason: with the same profiles, the best plan for LoRA and the
best plan for full fine-tuning differ where the bytes say they should, and each is measured faster
than the other's choice for its own method.

all-MiniLM-L6-v2 at world 2 (one thread per rank, pinned with --pin). The profiles are taken once
under the LoRA base config (they hold full fine-tuning's figures and LoRA's; or --profiles DIR of
a plan_accuracy.py --peft lora run at the same settings). plan.py search --json runs twice on them,
ample memory: on the LoRA config and on the same config without use_lora. Under full fine-tuning a
data-parallel replica all-reduces every gradient (90 MB a step), under LoRA only the adapters' (a
few hundred kB), while a Galaxy group or a pipeline moves activations whatever the method; so
where the link is slow for 90 MB but the batch is small, full fine-tuning should take a group or a
pipeline and LoRA the replicas. A subtler byte reason shows even on one machine's loopback: a
sequence-parallel sub-block's weights see only the rank's tokens, so the Galaxy group sums their
gradients every step (42 MB for all-MiniLM-L6-v2's ATT and MLP under full fine-tuning, LoRA's few
kB under LoRA): at batch 8 x 64 the search takes TP sub-blocks for full fine-tuning and SP ones for
LoRA. Both chosen plans then train under both methods with pretrain_galaxy.py, --rounds times each
in alternating order (each run's median step after the first; the least disturbed run counts), and
the bench prints, per method, the other's choice measured against its own (target: > 1 for both),
with the predicted step and bytes per step that explain it.

For a link like separate machines' (where DDP's 90 MB decides), run it on the edge testbed
(`--cluster FILE`, root): profile-devices and every training run start through `python -m
galaxy.edge run`, one rank per emulated device with its shaped link and CPU share, so the link
profile the search reads is the link the runs use.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/plan_peft.py --pin [--batch_size 8] [--pad_size 64] [--steps 8]
        [--rounds 3] [--profiles DIR] [--cluster clusters/two_equal_100m.json] [--out runs/bench/plan_peft]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from plan_accuracy import method_keys, method_of
from planning_runs import ROOT, env, profile, train, use_cluster, write_base

sys.path.insert(0, str(ROOT))

from galaxy.models.shape import read_model_shape  # noqa: E402
from galaxy.plan import Plan, Workload  # noqa: E402
from galaxy.planner.cost import CostModel  # noqa: E402
from galaxy.planner.profiles import load_devices, read_json  # noqa: E402
from galaxy.planner.table import describe  # noqa: E402

METHODS = ("full", "lora")


def best_keys(base: str, devices_path: str, model_path: str, out: Path, name: str) -> dict:
    """plan.py search --json on `base` (each device's own memory as its budget): the best plan's keys."""
    plans = out / f"{name}.plans.json"
    run = subprocess.run([sys.executable, "plan.py", "search", "--config_file", base, "--devices", devices_path,
                          "--model", model_path, "--out", str(out / f"{name}.json"), "--json", str(plans)],
                         cwd=ROOT, env=env(), capture_output=True, text=True)
    print(run.stdout + run.stderr)
    run.check_returncode()
    return json.loads(plans.read_text())["plans"][0]["keys"]


def predicted(costs: dict, keys: dict, shape: dict, pad: int, batch: int) -> dict:
    """{method: (step s, bytes sent per step by the busiest rank)} of the plan `keys` under each."""
    plan = Plan.from_keys(keys).resolve(2, Workload.of(shape, pad, batch))
    out = {}
    for method, cost in costs.items():
        est = cost.estimate(plan)
        out[method] = (est.step_s, max(est.sent_bytes))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--pad_size", type=int, default=64)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--lora_dim", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pin", action="store_true")
    p.add_argument("--profiles", help="a folder holding model.json and devices.json taken under the LoRA config")
    p.add_argument("--cluster", help="run profiles and training on the edge testbed's cluster FILE (two devices)")
    p.add_argument("--out", default="runs/bench/plan_peft")
    args = p.parse_args()
    use_cluster(args.cluster)
    out = ROOT / args.out
    cores = [0, 1] if args.pin else [None, None]
    bases = {"lora": write_base(out, pad_size=args.pad_size, batch_size=args.batch_size, steps=args.steps,
                                **method_keys("lora", args.lora_dim))}
    full = json.loads(Path(bases["lora"]).read_text())
    bases["full"] = str(out / "base_full.json")
    Path(bases["full"]).write_text(json.dumps({k: v for k, v in full.items()
                                               if k not in method_keys("lora", args.lora_dim)}, indent=1))
    if args.profiles:
        model_path, devices_path = str(ROOT / args.profiles / "model.json"), str(ROOT / args.profiles / "devices.json")
    else:
        model_path, devices_path = profile(out, bases["lora"], 2, cores)
    model = read_json(model_path)
    devices, link = load_devices(devices_path)
    costs = {"full": CostModel(model, devices, link, batch_size=args.batch_size),
             "lora": CostModel(model, devices, link, batch_size=args.batch_size, method=method_of(bases["lora"], model))}
    shape = read_model_shape(model["model_path"])
    choice = {m: best_keys(bases[m], devices_path, model_path, out, f"best_{m}") for m in METHODS}
    pred = {c: predicted(costs, choice[c], shape, args.pad_size, args.batch_size) for c in METHODS}
    for c in METHODS:
        d = describe(Plan.from_keys(choice[c]).resolve(2, Workload.of(shape, args.pad_size, args.batch_size)))
        print(f"best for {c}: pp x dp x g {d['mesh']}, {d['methods']}, {d['mb']} micro-batches; predicted "
              + ", ".join(f"under {m} {pred[c][m][0] * 1e3:.0f} ms, {pred[c][m][1] / 1e6:.2f} MB sent" for m in METHODS))
    result = {"args": vars(args), "choice": choice, "predicted": pred, "link_fit": link["fit"] if link else None}
    if choice["full"] == choice["lora"]:
        print("the two searches chose the same plan: nothing to measure (a slower link or a smaller batch "
              "makes DDP's bytes count; see the docstring)")
        (out / "results.json").write_text(json.dumps(result, indent=1))
        return
    runs = {(m, c): [] for m in METHODS for c in METHODS}
    order = list(runs)
    for r in range(args.rounds):
        for m, c in (order if r % 2 == 0 else order[::-1]):
            runs[m, c].append(train(out, bases[m], f"{m}-on-{c}-plan", choice[c], 2, cores)["step_s"])
        print(f"round {r + 1} of {args.rounds} done", flush=True)
    best = {k: min(v) for k, v in runs.items()}
    ratio = {m: best[m, [c for c in METHODS if c != m][0]] / best[m, m] for m in METHODS}
    for m in METHODS:
        other = [c for c in METHODS if c != m][0]
        print(f"{m}: its own choice {best[m, m] * 1e3:.0f} ms, {other}'s choice {best[m, other] * 1e3:.0f} ms "
              f"-> {ratio[m]:.2f}x (target > 1)")
    result.update(measured={f"{m} on {c}'s plan": v for (m, c), v in runs.items()}, ratio=ratio,
                  both_right=all(v > 1 for v in ratio.values()))
    (out / "results.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out / 'results.json'}")


if __name__ == "__main__":
    main()
