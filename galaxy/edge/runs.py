"""Runs of the testbed: a unique name each, a subnet no other run or host route has, and a state
file that says which launcher owns them.

A run is named gxe-<6 hex digits>; every namespace, link and cgroup it makes starts with that name
(PREFIX is what `clean` looks for). Before a launcher makes anything it writes
/run/galaxy-edge/<name>.json (its pid and that process's start time, the subnet), under a lock
that makes two launchers starting together pick different names and subnets. `clean` leaves alone
the runs whose launcher still lives and removes the rest.
"""
from __future__ import annotations

import fcntl
import ipaddress
import json
import os
import re
import secrets
from contextlib import contextmanager
from dataclasses import dataclass

from galaxy.edge.network import host_networks, pick_subnet
from galaxy.edge.shell import EdgeError

PREFIX = "gxe-"
RUN_NAME = re.compile(rf"^({PREFIX}[0-9a-f]{{6}})(?:$|-)")
STATE_DIR = "/run/galaxy-edge"


@dataclass(frozen=True)
class Run:
    name: str                           # gxe-1a2b3c
    subnet: ipaddress.IPv4Network
    pid: int                            # the launcher's
    started: int | None                 # its start time (clock ticks since boot), None: unknown


def run_of(thing: str) -> str | None:
    """The run name a namespace, link or cgroup folder name belongs to, or None."""
    m = RUN_NAME.match(thing)
    return m.group(1) if m else None


def process_start(pid: int) -> int | None:
    """When process pid started (field 22 of /proc/pid/stat), None if there is no such process:
    a pid alone could have been handed to another process since."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[19])


def is_live(run: Run) -> bool:
    start = process_start(run.pid)
    return start is not None and (run.started is None or start == run.started)


def state_path(name: str, state_dir: str = STATE_DIR) -> str:
    return os.path.join(state_dir, f"{name}.json")


def read_runs(state_dir: str = STATE_DIR) -> list[Run]:
    """Every run with a state file (unreadable ones skipped: `clean` finds their things by name)."""
    runs = []
    try:
        names = sorted(os.listdir(state_dir))
    except OSError:
        return runs
    for file in names:
        if not file.endswith(".json") or not run_of(file.removesuffix(".json")):
            continue
        try:
            with open(os.path.join(state_dir, file), encoding="utf-8") as f:
                raw = json.load(f)
            runs.append(Run(raw["name"], ipaddress.ip_network(raw["subnet"]), int(raw["pid"]), raw.get("started")))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return runs


@contextmanager
def locked(state_dir: str = STATE_DIR):
    """Hold the testbed's lock (launchers picking names and subnets, `clean` deciding what is dead)."""
    try:
        os.makedirs(state_dir, mode=0o755, exist_ok=True)
        fd = os.open(os.path.join(state_dir, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise EdgeError(f"cannot open the testbed's lock in {state_dir}: {e.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def new_run(state_dir: str = STATE_DIR) -> Run:
    """Claim a name and a subnet for this process's run and record them (under the lock)."""
    with locked(state_dir):
        recorded = read_runs(state_dir)
        live = [r for r in recorded if is_live(r)]
        taken = {r.name for r in recorded}      # dead runs too, until `clean` removes their things
        name = next(n for n in (f"{PREFIX}{secrets.token_hex(3)}" for _ in range(1000)) if n not in taken)
        subnet = pick_subnet(host_networks() + [r.subnet for r in live])
        run = Run(name, subnet, os.getpid(), process_start(os.getpid()))
        # /run is memory (tmpfs), gone at a reboot with the namespaces themselves: a rename makes
        # the file appear whole, and there is nothing for fsync (galaxy.files) to make durable.
        path = state_path(name, state_dir)
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump({"name": name, "subnet": str(subnet), "pid": run.pid, "started": run.started}, f)
        os.replace(path + ".tmp", path)
        return run


def forget(name: str, state_dir: str = STATE_DIR) -> None:
    """Remove a run's state file (after everything it made is gone)."""
    try:
        os.unlink(state_path(name, state_dir))
    except FileNotFoundError:
        pass
