"""Shared by bench/plan_accuracy.py and bench/plan_unequal.py: profile with plan.py, run planned
configs with pretrain_galaxy.py as users run them (one process per rank over loopback, optionally
pinned to a core each with taskset), and read what they measured back from the metrics file."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MODEL = ROOT / "models" / "all-MiniLM-L6-v2"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict:
    return dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def pin(core: int | None) -> list[str]:
    """taskset -c CORE, when pinning is asked for and taskset exists."""
    if core is None or shutil.which("taskset") is None:
        return []
    return ["taskset", "-c", str(core % os.cpu_count())]


def write_data(folder: Path, rows: int) -> tuple[str, list[str]]:
    """A TSV of `rows` pydoc-topics passages (no dev/test set: no evaluation at the end of a run)
    and the class names."""
    from galaxy.data import pydoc_topics_dataset
    examples, names = pydoc_topics_dataset("train")
    path = folder / "train.tsv"
    path.write_text("".join(f"{' '.join(t.split())}\t{names[y]}\n" for t, y in examples[:rows]))
    return str(path), list(names)


def write_base(folder: Path, *, pad_size: int, batch_size: int, steps: int, **extra) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    train_path, names = write_data(folder, batch_size * (steps + 2))
    cfg = {"model_path": str(MODEL), "train_path": train_path, "class_list": names, "pad_size": pad_size,
           "batch_size": batch_size, "max_steps": steps, "optimizer": "adamw", "learning_rate": 1e-4,
           "shuffle": False, "seed": 42, "timeout_s": 300, **extra}
    path = folder / "base.json"
    path.write_text(json.dumps(cfg, indent=1))
    return str(path)


# A cluster file (clusters/*.json) to run every multi-rank command on: `python -m galaxy.edge run`
# then starts one rank per emulated device (its namespace, shaped link, CPU share and memory limit)
# instead of one process per rank over loopback; the device count must equal the world.
CLUSTER: str | None = None


def use_cluster(path: str | None) -> None:
    global CLUSTER
    CLUSTER = str(Path(path).resolve()) if path else None


def _cluster_of(world: int) -> str:
    """CLUSTER, or its first `world` devices (a serial run takes the first device alone)."""
    doc = json.loads(Path(CLUSTER).read_text())
    if len(doc["devices"]) == world:
        return CLUSTER
    if len(doc["devices"]) < world:
        raise ValueError(f"{CLUSTER} has {len(doc['devices'])} devices, the run wants {world}")
    path = Path(tempfile.gettempdir()) / f"{Path(CLUSTER).stem}-first{world}.json"
    path.write_text(json.dumps({**doc, "devices": doc["devices"][:world]}, indent=1))
    return str(path)


def _rank_commands(argv: list[str], world: int, cores: list[int | None]) -> list[list[str]]:
    if CLUSTER:     # the testbed adds --world, --rank and --init_method itself
        return [[sys.executable, "-m", "galaxy.edge", "run", "--cluster", _cluster_of(world), "--", sys.executable,
                 *argv]]
    port = free_port()
    return [[*pin(cores[r]), sys.executable, *argv, "--world", str(world), "--rank", str(r),
             "--init_method", f"tcp://127.0.0.1:{port}"] for r in range(world)]


def run_ranks(argv: list[str], world: int, cores: list[int | None], timeout: float = 1200) -> list[str]:
    """Start `python *argv --world W --rank R --init_method ...` per rank (or the testbed's launcher
    once, under CLUSTER); every process's stdout. A failed or timed-out rank stops them all: a peer
    left waiting in a collective would hold its port and cores for the next run."""
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
             for cmd in _rank_commands(argv, world, cores)]
    try:
        outs = []
        for r, p in enumerate(procs):
            out, err = p.communicate(timeout=timeout)
            if p.returncode:
                raise RuntimeError(f"rank {r} of {' '.join(argv)} exited {p.returncode}:\n{(err or out)[-3000:]}")
            outs.append(out)
        return outs
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)     # the launcher passes it on to its ranks
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()


def profile(folder: Path, base: str, world: int, cores: list[int | None], repeats: int = 3,
            statistic: str = "median", timeout: float = 1200, extra: tuple = ()) -> tuple[str, str]:
    """plan.py profile-model and profile-devices (world ranks, pinned like training; timeout: the
    seconds profile-devices may take; extra: more profile-devices flags); their paths."""
    model, devices = str(folder / "model.json"), str(folder / "devices.json")
    subprocess.run([*pin(cores[0]), sys.executable, "plan.py", "profile-model", "--config_file", base, "--out", model],
                   cwd=ROOT, env=env(), check=True, capture_output=True)
    run_ranks(["plan.py", "profile-devices", "--config_file", base, "--out", devices, "--repeats", str(repeats),
               "--statistic", statistic, *extra], world, cores, timeout)
    return model, devices


def train(folder: Path, base: str, name: str, keys: dict, world: int, cores: list[int | None],
          statistic: str = "median") -> dict:
    """Train `base` with `keys` over it under pretrain_galaxy.py: {"step_s" (the median, or min, step
    time after the first), "step_times", "peak_mib" (per rank)}."""
    cfg = json.loads(Path(base).read_text())
    cfg.update(keys, metrics_file=str(folder / f"{name}.jsonl"))
    path = folder / f"{name}.json"
    path.write_text(json.dumps(cfg, indent=1))
    if os.path.exists(cfg["metrics_file"]):
        os.remove(cfg["metrics_file"])
    run_ranks(["pretrain_galaxy.py", "--config_file", str(path)], world, cores)
    records = [json.loads(line) for line in Path(cfg["metrics_file"]).read_text().splitlines()]
    times = [r["time_s"] for r in records if "event" not in r and "time_s" in r]
    done = [r for r in records if r.get("event") == "done"][-1]
    pick = min if statistic == "min" else statistics.median
    return {"step_s": pick(times[1:] or times), "step_times": times, "peak_mib": done["peak_memory_mib"]}


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else float("nan")
