"""Galaxy's overlapped pipeline engine against torch's schedules, side by side on the edge testbed.

Each config (a pretrain_galaxy.py config with pp_deg > 1) is launched `--repeats` times under each
engine, alternating (galaxy, torch, torch, galaxy, ...), one testbed lock per launch, so drifting
host load falls on both. GALAXY_PP_ENGINE=torch picks torch's schedules (galaxy.pipeline.schedule).
Prints, per config and engine, every launch's median step time over steps 2-5 and its peak memory
per rank, then the median of the launches and the ratio galaxy / torch.

    .venv/bin/python bench/pp_engines.py --cluster clusters/edge4.json --repeats 3 \\
        --config searched=/tmp/e4/full/searched.json --config even=/tmp/e4/full/even_pipeline.json
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cluster", required=True)
    p.add_argument("--config", action="append", required=True, metavar="NAME=CONFIG.json")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout_s", type=int, default=300)
    p.add_argument("--json", help="write every launch's figures here")
    args = p.parse_args()
    if any("=" not in c for c in args.config):
        p.error("--config takes NAME=CONFIG.json")
    configs = {name: json.loads(Path(path).read_text()) for name, path in (c.split("=", 1) for c in args.config)}
    out = Path(tempfile.mkdtemp(prefix="pp_engines_"))
    results = {name: {e: [] for e in ENGINES} for name in configs}
    for rep in range(args.repeats):
        for name, config in configs.items():
            for engine in ENGINES if rep % 2 == 0 else ENGINES[::-1]:
                load = os.getloadavg()[0]
                r = {**launch(args.cluster, config, engine, out, args.timeout_s), "load": load}
                results[name][engine].append(r)
                print(f"{name:10s} {engine:6s} rep {rep}: " + (f"step {r['step_s']:.4f} s, peak {r['peak_mib']} MiB"
                      if "step_s" in r else f"FAILED {r['error']}") + f", load {load:.2f}", flush=True)
    for name, by in results.items():
        med = {e: statistics.median([r["step_s"] for r in rs if "step_s" in r] or [float("nan")])
               for e, rs in by.items()}
        print(f"{name}: galaxy {med['galaxy']:.4f} s, torch {med['torch']:.4f} s, "
              f"galaxy/torch {med['galaxy'] / med['torch']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    sys.exit(main())
