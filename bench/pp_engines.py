"""Galaxy's overlapped pipeline engine against torch's schedules, side by side on the edge testbed.

Each config (a pretrain_galaxy.py config with pp_deg > 1) is launched `--repeats` times under each
engine of --engines, alternating (the launch order of a repeat reversed in the next one), one
testbed lock per launch, so drifting host load falls on both. GALAXY_PP_ENGINE=torch picks torch's
schedules (galaxy.pipeline.schedule). `--warmup NAME=9,5,3,1` also launches each 1f1b config with
those warm-ups per stage (pipeline_warmup_list), under Galaxy's engine only (torch's schedules
cannot run them), alternating with the rest. Prints every launch's median step time over steps
2-5 and its peak memory per rank, then per config and engine the median of the launches, the
ratio galaxy / torch and each warm-up's ratio to the config's own warm-ups under Galaxy's engine.

    .venv/bin/python bench/pp_engines.py --cluster clusters/edge4.json --repeats 3 \\
        --config searched=/tmp/e4/full/searched.json --config even=/tmp/e4/full/even_pipeline.json
    .venv/bin/python bench/pp_engines.py --cluster clusters/edge4.json --repeats 3 --engines galaxy \\
        --config searched=/tmp/e4/full/searched.json --warmup deep=9,5,3,1
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENGINES = ("galaxy", "torch")


def launch(cluster: str, config: dict, engine: str, out: Path, timeout_s: int) -> dict:
    """One testbed launch of pretrain_galaxy.py on `config` under `engine`: {step_s, steps, peak_mib}."""
    metrics = out / f"{engine}_{os.getpid()}_{len(list(out.iterdir()))}.jsonl"
    cfg = out / (metrics.stem + ".json")
    cfg.write_text(json.dumps({**config, "metrics_file": str(metrics)}))
    python = str(ROOT / ".venv/bin/python")
    cmd = ["flock", "/work/testbed.lock", "timeout", str(timeout_s), python, "-m", "galaxy.edge", "run", "--shield",
           "--cluster", cluster, "--", "env", f"GALAXY_PP_ENGINE={engine}", python,
           str(ROOT / "pretrain_galaxy.py"), "--config_file", str(cfg)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        return {"error": (done.stderr or done.stdout).strip().splitlines()[-1:]}
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r["time_s"] for r in rows if "time_s" in r and "step" in r]
    end = next(r for r in rows if r.get("event") == "done")
    return {"step_s": statistics.median(steps[1:5]), "steps": steps, "peak_mib": end.get("peak_memory_mib")}


def launches(configs: dict, engines: list[str], warmups: dict) -> list[tuple[str, str, dict]]:
    """(label, engine, config) of one repeat's launches: every config under every engine, then
    each warm-up variant ("config+NAME") of every 1f1b config under Galaxy's engine."""
    runs = [(name, e, config) for name, config in configs.items() for e in engines]
    runs += [(f"{name}+{w}", "galaxy", {**config, "pipeline_warmup_list": counts})
             for name, config in configs.items() if config.get("pipeline_schedule", "1f1b") == "1f1b"
             for w, counts in warmups.items()]
    return runs


def summary(results: dict) -> list[str]:
    """Per label and engine: the median step of the launches and the median peak per rank; the
    ratio galaxy / torch, and a warm-up variant's ratio to its config under Galaxy's engine."""
    lines, med = [], {}
    for label, by in results.items():
        for engine, rs in by.items():
            ok = [r for r in rs if "step_s" in r]
            if not ok:
                continue
            med[label, engine] = statistics.median(r["step_s"] for r in ok)
            peaks = ([statistics.median(r["peak_mib"][i] for r in ok) for i in range(len(ok[0]["peak_mib"]))]
                     if all(r["peak_mib"] for r in ok) else "unknown")
            each = ", ".join(f"{r['step_s']:.3f}" for r in ok)
            lines.append(f"{label} {engine}: {med[label, engine]:.4f} s (launches {each}), "
                         f"peak MiB per rank {peaks}")
    for (label, engine), t in med.items():
        if engine == "torch" and (label, "galaxy") in med:
            lines.append(f"{label}: galaxy/torch {med[label, 'galaxy'] / t:.3f}")
        base = label.split("+")[0]
        if label != base and (base, "galaxy") in med:
            lines.append(f"{label}: against {base}'s default warm-ups {t / med[base, 'galaxy']:.3f}")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cluster", required=True)
    p.add_argument("--config", action="append", required=True, metavar="NAME=CONFIG.json")
    p.add_argument("--engines", default=",".join(ENGINES), help="comma-separated, of galaxy,torch")
    p.add_argument("--warmup", action="append", default=[], metavar="NAME=W0,W1,...",
                   help="also run each 1f1b config with pipeline_warmup_list W0,W1,... (Galaxy's engine)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout_s", type=int, default=300)
    p.add_argument("--json", help="write every launch's figures here")
    args = p.parse_args()
    if any("=" not in c for c in args.config + args.warmup):
        p.error("--config takes NAME=CONFIG.json and --warmup NAME=W0,W1,...")
    engines = args.engines.split(",")
    if not set(engines) <= set(ENGINES):
        p.error(f"--engines {args.engines!r}: use a comma-separated subset of {','.join(ENGINES)}")
    configs = {name: json.loads(Path(path).read_text()) for name, path in (c.split("=", 1) for c in args.config)}
    try:
        warmups = {name: [int(n) for n in counts.split(",")] for name, counts in (w.split("=", 1) for w in args.warmup)}
    except ValueError:
        p.error("--warmup takes NAME=W0,W1,... with one whole number per stage")
    out = Path(tempfile.mkdtemp(prefix="pp_engines_"))
    runs = launches(configs, engines, warmups)
    results: dict = {}
    for rep in range(args.repeats):
        for label, engine, config in runs if rep % 2 == 0 else runs[::-1]:
            load = os.getloadavg()[0]
            r = {**launch(args.cluster, config, engine, out, args.timeout_s), "load": load}
            results.setdefault(label, {}).setdefault(engine, []).append(r)
            print(f"{label:10s} {engine:6s} rep {rep}: " + (f"step {r['step_s']:.4f} s, peak {r['peak_mib']} MiB"
                  if "step_s" in r else f"FAILED {r['error']}") + f", load {load:.2f}", flush=True)
    print("\n".join(summary(results)))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    sys.exit(main())
