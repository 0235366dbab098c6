"""The cluster file: the devices a testbed emulates, read and checked before anything is built.

    {"devices": [
       {"name": "laptop", "cpus": 1.0, "memory_mib": 3000, "link_mbit": 1000},
       {"name": "pi", "cpus": 0.35, "memory_mib": 900, "link_mbit": 100, "threads": 1}]}

Device i is rank i. Every problem is one line naming the device and the key (galaxy.config's
ConfigError, all problems at once), so a bad file costs one failed start and no cleanup.
"""
from __future__ import annotations

import difflib
import json
import math
import os
import re
from dataclasses import dataclass

from galaxy.config import ConfigError

# The least CPU share: the testbed's CFS period is 10 ms (galaxy.edge.cgroups) and the kernel's
# least quota is 1 ms.
MIN_CPUS = 0.1
MAX_DEVICES = 64
# A device's name becomes its host name and prefixes its output: a lower-case host name label.
NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?$")
KEYS = {
    "name": "the device's name, e.g. \"pi\" (lower-case letters, digits and '-')",
    "cpus": "its CPU share in cores, e.g. 0.5",
    "memory_mib": "its memory limit in MiB",
    "link_mbit": "its link's rate in Mbit/s, both directions",
    "latency_ms": "delay added to each packet on its link (needs the kernel's netem)",
    "threads": "torch threads (default: cpus rounded up)",
    "cpuset": "the host CPUs it may run on, e.g. \"0\" or \"0-1\"",
}
REQUIRED = ("name", "cpus", "memory_mib", "link_mbit")


@dataclass(frozen=True)
class Device:
    name: str
    cpus: float                 # cores: the CFS quota over the period
    memory_mib: int
    link_mbit: float
    threads: int                # OMP_NUM_THREADS of its rank
    latency_ms: float = 0.0
    cpuset: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Cluster:
    path: str
    devices: tuple[Device, ...]
    warnings: tuple[str, ...]   # runnable, but not what the file asks (shares past the host's cores)


def host_cpus() -> set[int]:
    """The CPUs this process may run on: what every device's share and cpuset come out of."""
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:
        return set(range(os.cpu_count() or 1))


def load_cluster(path: str, cpus: set[int] | None = None) -> Cluster:
    """Read and check a cluster file against this host's CPUs (`cpus`, default host_cpus())."""
    cpus = host_cpus() if cpus is None else cpus
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read the cluster file {path!r}: {e.strerror}; give --cluster a JSON file "
                          f"such as clusters/home3.json") from None
    except ValueError as e:
        raise ConfigError(f"cluster file {path!r} is not valid JSON: {e}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("devices"), list) or not raw["devices"]:
        raise ConfigError(f"cluster file {path!r} must hold {{\"devices\": [{{\"name\": ..., \"cpus\": ..., "
                          f"\"memory_mib\": ..., \"link_mbit\": ...}}, ...]}} with at least one device")
    problems = [f"{path}: unknown top-level key '{k}'; the file holds \"devices\" (keys starting with '_' are "
                f"comments)" for k in raw if k != "devices" and not k.startswith("_")]
    if len(raw["devices"]) > MAX_DEVICES:
        problems.append(f"{path}: {len(raw['devices'])} devices; a testbed holds at most {MAX_DEVICES}")
    devices = []
    for i, entry in enumerate(raw["devices"]):
        where = f"{path}: devices[{i}]"
        if not isinstance(entry, dict):
            problems.append(f"{where} must be an object {{\"name\": ..., \"cpus\": ...}}, got {entry!r}")
            continue
        if isinstance(entry.get("name"), str):
            where += f" '{entry['name']}'"
        device, found = check_device(where, entry, cpus)
        problems += found
        if device is not None:
            devices.append(device)
    names = [d.name for d in devices]
    problems += [f"{path}: two devices are named '{n}'; give every device its own name"
                 for n in sorted({n for n in names if names.count(n) > 1})]
    if problems:
        raise ConfigError(*problems)
    return Cluster(path, tuple(devices), tuple(cluster_warnings(devices, cpus)))


def check_device(where: str, entry: dict, host: set[int]) -> tuple[Device | None, list[str]]:
    """(the device, []) or (None, one line per problem)."""
    problems = [unknown_key(where, k) for k in entry if k not in KEYS and not k.startswith("_")]
    problems += [f"{where}: '{k}' is missing: {KEYS[k]}" for k in REQUIRED if k not in entry]
    name, cpus = entry.get("name"), entry.get("cpus")
    if "name" in entry and not (isinstance(name, str) and NAME.match(name)):
        problems.append(f"{where}: name must be 1-32 lower-case letters, digits or '-' (a host name), got {name!r}")
    problems += out_of_range(where, "cpus", cpus, MIN_CPUS, len(host),
                             f"{len(host)}, the CPUs this host gives the testbed")
    problems += out_of_range(where, "memory_mib", entry.get("memory_mib"), 64, None, "")
    problems += out_of_range(where, "link_mbit", entry.get("link_mbit"), 0.1, 100_000, "100000")
    problems += out_of_range(where, "latency_ms", entry.get("latency_ms", 0), 0, 10_000, "10000")
    threads = entry.get("threads")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        problems.append(f"{where}: threads must be a whole number of at least 1, got {threads!r}")
    cpuset, found = parse_cpuset(where, entry.get("cpuset"), host)
    problems += found
    if cpuset is not None and not problems and len(cpuset) < math.ceil(cpus):
        problems.append(f"{where}: cpus {cpus:g} needs {math.ceil(cpus)} CPUs but cpuset gives {len(cpuset)}; "
                        f"widen cpuset or lower cpus")
    if problems:
        return None, problems
    return Device(name=name, cpus=float(cpus), memory_mib=int(entry["memory_mib"]),
                  link_mbit=float(entry["link_mbit"]), threads=threads or math.ceil(cpus),
                  latency_ms=float(entry.get("latency_ms", 0)), cpuset=cpuset), []


def unknown_key(where: str, key: str) -> str:
    close = difflib.get_close_matches(key, list(KEYS), n=1)
    hint = f"did you mean '{close[0]}'?" if close else "valid keys: " + ", ".join(KEYS)
    return f"{where}: unknown key '{key}'; {hint}"


def out_of_range(where: str, key: str, value, low: float, high: float | None, high_text: str) -> list[str]:
    """[] when value is absent (missing keys are reported apart) or a number in [low, high]."""
    if value is None:
        return []
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and value >= low and (high is None or value <= high):
        return []
    span = f"from {low:g} to {high_text}" if high is not None else f"of at least {low:g}"
    return [f"{where}: {key} must be a number {span}, got {value!r}"]


def parse_cpuset(where: str, value, host: set[int]) -> tuple[tuple[int, ...] | None, list[str]]:
    """"0-1,3" or [0, 1, 3] -> (0, 1, 3); every CPU must be one this host gives us."""
    if value is None:
        return None, []
    cpus = set()
    try:
        items = value if isinstance(value, list) else str(value).split(",")
        for item in items:
            if isinstance(item, int) and not isinstance(item, bool):
                cpus.add(item)
                continue
            first, _, last = str(item).strip().partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    except ValueError:
        cpus = set()
    if not cpus:
        return None, [f"{where}: cpuset must list CPUs like \"0-1,3\" or [0, 1, 3], got {value!r}"]
    if not cpus <= host:
        return None, [f"{where}: cpuset names CPU {min(cpus - host)}, which this host does not give us; "
                      f"use CPUs from {format_cpus(host)}"]
    return tuple(sorted(cpus)), []


def format_cpus(cpus) -> str:
    """(0, 1, 2, 5) -> "0-2,5"."""
    out, run = [], []
    for c in sorted(cpus):
        if run and c != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(c)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def cluster_warnings(devices: list[Device], host: set[int]) -> list[str]:
    total = sum(d.cpus for d in devices)
    if total > len(host) + 1e-9:
        return [f"the devices' cpus add up to {total:g}, more than this host's {len(host)} CPUs: busy devices "
                f"will get less than their share"]
    return []
