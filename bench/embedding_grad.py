"""The word embedding's rows accumulated in place against the dense lookup, on the edge testbed.

One plan (a config, e.g. plan_cluster.py's searched.json) trains --launches times in each engine,
alternating (dense, rows, dense, rows, ...), each launch under its own `flock /work/testbed.lock`
and `--shield`: GALAXY_EMBEDDING_GRAD=dense keeps the dense lookup (galaxy.parallel.
embedding_grad), unset the rows go into .grad in place. Prints every launch's step median (steps
2 and on) and each device's cgroup peak, the medians over launches, and the cost model's
prediction of both engines from the plan's devices profile (the dense one with
rows_accumulate_in_place off), and writes results.json to --out. --time_backward runs each launch
through bench/embedding_backward_timer.py: the table's backward plus its accumulation into .grad
per step (summed over the micro-batches) and the zeroing, on the rank that holds the table.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/embedding_grad.py --cluster clusters/edge4.json \\
        --config /tmp/e4/full/searched.json --devices /tmp/e4/full/devices.json \\
        --model /tmp/e4/full/model.json [--only DEVICE] [--launches 3] [--steps 5] [--time_backward]
        [--out /tmp/embgrad/edge4]

needs root (the testbed).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_cluster import DEVICE_LINE, predictor       # noqa: E402
from planning_runs import ROOT, env                   # noqa: E402

LOCK = "/work/testbed.lock"
CPU_LINE = re.compile(r"galaxy\.edge: device \S+ \(rank (\d+)\): .*CPU time (\S+) s")
ENGINES = {"dense": "dense", "rows": ""}             # GALAXY_EMBEDDING_GRAD per engine


def launch(cluster: str, config: Path, engine: str, timeout: int, times: Path | None) -> dict:
    """One launch: {"step_s" (median of steps 2 on), "step_times", "peak_mib", "cpu_s" (per device,
    the whole run's), "status"; with times: "embedding_ms" (per step), "zeroing_ms" (per step)}."""
    cfg = json.loads(config.read_text())
    metrics = Path(cfg["metrics_file"])
    metrics.unlink(missing_ok=True)
    script = "bench/embedding_backward_timer.py" if times else "pretrain_galaxy.py"
    cmd = ["flock", LOCK, "timeout", str(timeout), sys.executable, "-m", "galaxy.edge", "run", "--shield",
           "--cluster", cluster, "--", sys.executable, script, "--config_file", str(config)]
    extra = {"EMBGRAD_TIMES": str(times)} if times else {}
    if times:
        times.unlink(missing_ok=True)
    done = subprocess.run(cmd, cwd=ROOT, env={**env(), **extra, "GALAXY_EMBEDDING_GRAD": ENGINES[engine]},
                          capture_output=True, text=True)
    text = done.stdout + done.stderr
    peaks = {int(m[2]): float(m[4]) if m[4] != "?" else None for m in DEVICE_LINE.finditer(text)}
    cpu = {int(m[1]): float(m[2]) if m[2] != "?" else None for m in CPU_LINE.finditer(text)}
    got = {"engine": engine, "peak_mib": [peaks.get(r) for r in sorted(peaks)],
           "cpu_s": [cpu.get(r) for r in sorted(cpu)],
           "status": "ok" if done.returncode == 0 else f"exit {done.returncode}: {text.strip()[-300:]}",
           "load": os.getloadavg()[0]}
    if done.returncode == 0:
        steps = [r["time_s"] for r in map(json.loads, metrics.read_text().splitlines())
                 if "event" not in r and "time_s" in r]
        got.update(step_s=statistics.median(steps[1:] or steps), step_times=steps)
    if times and times.exists():
        m = cfg.get("num_microbatches") if cfg.get("pp_deg", 1) > 1 else cfg.get("grad_accum_steps", 1)
        rec = json.loads(times.read_text().splitlines()[0])
        got["embedding_ms"] = [round(sum(rec["bwd_ms"][i:i + m]), 2) for i in range(0, len(rec["bwd_ms"]), m)]
        got["zeroing_ms"] = rec["hook_ms"]
    return got


def predictions(cfg_path: Path, cfg: dict, devices: str, model: str, only: int | None) -> dict:
    """{engine: {"predicted_step_s", "predicted_memory_mib"}} from the cost model as it is now
    (only: that device of the profile alone)."""
    from galaxy.planner.cost import CostModel
    args = SimpleNamespace(batch_size=cfg["batch_size"], pad_size=cfg["pad_size"])
    world = 1 if only is not None else len(json.loads(Path(devices).read_text())["devices"])
    keys = {k: v for k, v in cfg.items() if k in PLAN_KEYS}
    out = {"rows": predictor(str(cfg_path), model, devices, world, args, only)(keys)}
    in_place = CostModel.rows_accumulate_in_place
    CostModel.rows_accumulate_in_place = lambda self, plan: False
    try:
        out["dense"] = predictor(str(cfg_path), model, devices, world, args, only)(keys)
    finally:
        CostModel.rows_accumulate_in_place = in_place
    return out


PLAN_KEYS = ("att_parallel_method", "mlp_parallel_method", "con_parallel_method", "pp_deg", "dp_deg",
             "activation_checkpointing", "num_microbatches", "pipeline_schedule", "stage_num_hidden_layers_list",
             "grad_accum_steps", "tp_num_attention_heads_list", "tp_intermediate_size_list", "seq_scatter_list",
             "dp_batch_list", "dp_sharding")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cluster", required=True)
    p.add_argument("--config", required=True, help="the plan's training config (its train_path, model_path)")
    p.add_argument("--devices", required=True, help="the cluster's devices profile (plan.py profile-devices)")
    p.add_argument("--model", required=True, help="the model profile (plan.py profile-model)")
    p.add_argument("--only", type=int, help="a one-device cluster: that device of --devices")
    p.add_argument("--launches", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--timeout", type=int, default=600, help="seconds one launch may take")
    p.add_argument("--time_backward", action="store_true", help="through bench/embedding_backward_timer.py")
    p.add_argument("--out", default="/tmp/embgrad")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {**json.loads(Path(args.config).read_text()), "max_steps": args.steps}
    configs = {}
    for engine in ENGINES:
        configs[engine] = out / f"{engine}.json"
        configs[engine].write_text(json.dumps({**cfg, "metrics_file": str(out / f"{engine}.jsonl")}, indent=1))
    predicted = predictions(configs["rows"], cfg, args.devices, args.model, args.only)
    runs = []
    for i in range(args.launches):
        for engine in ENGINES:
            times = out / f"times_{engine}.jsonl" if args.time_backward else None
            got = launch(args.cluster, configs[engine], engine, args.timeout, times)
            runs.append(got)
            print(f"launch {i + 1} {engine:5s} step {got.get('step_s', float('nan')) * 1e3:7.1f} ms  peak MiB "
                  f"{got['peak_mib']}  CPU s {got['cpu_s']}  load {got['load']:.2f}  "
                  f"{got['status'] if got['status'] != 'ok' else ''}", flush=True)
            if "embedding_ms" in got:
                print(f"    embedding backward + accumulation per step (ms) {got['embedding_ms']}, "
                      f"zeroing per step (ms) {got['zeroing_ms']}", flush=True)
    summary = {}
    for engine in ENGINES:
        ok = [r for r in runs if r["engine"] == engine and r["status"] == "ok"]
        if not ok:
            continue
        peaks = [statistics.median(r["peak_mib"][d] for r in ok) for d in range(len(ok[0]["peak_mib"]))]
        summary[engine] = {"step_s": statistics.median(r["step_s"] for r in ok), "peak_mib": peaks, **predicted[engine]}
        pred = predicted[engine]
        print(f"{engine:5s} median step {summary[engine]['step_s'] * 1e3:.1f} ms (predicted "
              f"{pred['predicted_step_s'] * 1e3:.1f}), peak MiB {peaks} (predicted {pred['predicted_memory_mib']})")
        backward = [ms for r in ok for ms in r.get("embedding_ms", [])[1:]]      # steps 2 on
        if backward:
            summary[engine]["embedding_ms"] = statistics.median(backward)
            print(f"      embedding backward + accumulation per step, median of steps 2 on: "
                  f"{summary[engine]['embedding_ms']:.1f} ms")
    if len(summary) == 2:
        print(f"dense / rows step: {summary['dense']['step_s'] / summary['rows']['step_s']:.3f}")
    (out / "results.json").write_text(json.dumps({"runs": runs, "summary": summary, "predicted": predicted,
                                                  "config": str(args.config)}, indent=1))


if __name__ == "__main__":
    main()
