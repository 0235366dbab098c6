"""What a process's cgroup allows and has used: memory limit, peak, OOM kills, CPU time and quota (v1, v2).

A rank on a device with a memory ceiling (a container, a systemd slice, a device of the edge
testbed, galaxy.edge) may use what its cgroup allows, not the host's MemAvailable, and the kernel
counts against that limit everything the cgroup holds, the page cache of files it read included.
So the planner's budget (galaxy.planner.device_profile) and the trainer's peak memory
(galaxy.train.summary) read the cgroup when one limits the rank, and the edge testbed reads the
same files for the devices it made.

The files, by hierarchy (bytes unless said):

| figure         | cgroup v1 (memory, cpuacct controllers)              | cgroup v2                  |
|----------------|------------------------------------------------------|----------------------------|
| limit          | memory.stat hierarchical_memory_limit (the least of   | memory.max of the cgroup   |
|                | the cgroup's and its ancestors' limits)               | and its ancestors, least   |
| peak           | memory.max_usage_in_bytes                            | memory.peak (Linux 5.19+)  |
| OOM kills      | memory.oom_control oom_kill (Linux 4.13+)            | memory.events oom_kill     |
| CPU time       | cpuacct.usage (ns)                                   | cpu.stat usage_usec        |
| CPU quota      | cpu.cfs_quota_us / cpu.cfs_period_us (-1: none)       | cpu.max "QUOTA PERIOD"     |

A figure the kernel does not offer reads as None. Paths come from /proc/<pid>/cgroup (the cgroup of
each hierarchy) and /proc/self/mountinfo (where each hierarchy is mounted); both are parameters so
that tests can hand in a made-up host.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

# v1 spells "no limit" as 2**63 - 1 rounded down to a page; nothing a machine holds comes near 2**62.
V1_NO_LIMIT = 1 << 62


@dataclass(frozen=True)
class Mount:
    """One mounted cgroup hierarchy."""
    point: str                  # where it is mounted, e.g. /sys/fs/cgroup/memory
    root: str                   # the cgroup shown at `point` ("/" unless inside a cgroup namespace)
    version: int                # 1 or 2
    controllers: frozenset      # v1: from the mount options; v2: the root's cgroup.controllers


@dataclass(frozen=True)
class Memory:
    limit: int | None           # bytes; None: no limit
    peak: int | None            # bytes
    oom_kills: int | None       # processes the kernel killed for this cgroup's limit


def mounts(mountinfo: str = "/proc/self/mountinfo") -> list[Mount]:
    """Every cgroup hierarchy mounted in this process's mount namespace."""
    out = []
    try:
        with open(mountinfo, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return out
    for line in lines:
        # "36 25 0:32 / /sys/fs/cgroup/memory rw,relatime shared:9 - cgroup cgroup rw,memory"
        fields, _, tail = line.partition(" - ")
        fields, tail = fields.split(), tail.split()
        if len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        point = fields[4].replace("\\040", " ")
        if tail[0] == "cgroup":
            names = frozenset(tail[2].split(",")) - {"rw", "ro"}
            out.append(Mount(point, fields[3], 1, names))
        else:
            names = frozenset(read_text(os.path.join(point, "cgroup.controllers")).split())
            out.append(Mount(point, fields[3], 2, names))
    return out


def controller_mount(controller: str, mount_list: list[Mount]) -> Mount | None:
    """The hierarchy that holds `controller`: a v1 mount naming it, else a v2 mount offering it
    (on a hybrid host a controller bound to v1 is absent from the v2 root's cgroup.controllers)."""
    for version in (1, 2):
        for m in mount_list:
            if m.version == version and controller in m.controllers:
                return m
    return None


def process_dir(controller: str, pid: str = "self", mount_list: list[Mount] | None = None,
                proc: str = "/proc") -> str | None:
    """The folder of the cgroup that holds process `pid` in `controller`'s hierarchy."""
    mount_list = mounts() if mount_list is None else mount_list
    m = controller_mount(controller, mount_list)
    if m is None:
        return None
    for line in read_text(os.path.join(proc, str(pid), "cgroup")).splitlines():
        # v1: "4:memory:/a/b" (or "4:cpu,cpuacct:/a"); v2: "0::/a/b"
        _, names, path = line.split(":", 2)
        if (m.version == 2 and names == "") or (m.version == 1 and controller in names.split(",")):
            inside = os.path.relpath(path, m.root) if path.startswith(m.root) else None
            if inside is None or inside.startswith(".."):
                return None             # the cgroup lies outside what this mount shows
            return os.path.normpath(os.path.join(m.point, inside))
    return None


def read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return ""


def keyed(path: str, key: str) -> int | None:
    """The number after `key` in a "key value" per line file (memory.stat, memory.events, cpu.stat)."""
    for line in read_text(path).splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return None


def number(path: str) -> int | None:
    text = read_text(path).strip()
    return int(text) if text.isdigit() else None


def memory_limit(directory: str, version: int, top: str | None = None) -> int | None:
    """Bytes the cgroup at `directory` may hold, the least of its own and its ancestors' limits
    (v2: walked up to `top`, the hierarchy's mount point); None when nothing limits it."""
    if version == 1:
        limit = keyed(os.path.join(directory, "memory.stat"), "hierarchical_memory_limit")
        if limit is None:
            limit = number(os.path.join(directory, "memory.limit_in_bytes"))
        return limit if limit is not None and limit < V1_NO_LIMIT else None
    limits, here = [], os.path.normpath(directory)
    top = os.path.normpath(top) if top else os.path.dirname(here)
    while True:
        value = number(os.path.join(here, "memory.max"))     # "max" (no limit) reads as None
        if value is not None:
            limits.append(value)
        if here == top or os.path.dirname(here) == here:
            break
        here = os.path.dirname(here)
    return min(limits) if limits else None


def memory(directory: str, version: int, top: str | None = None) -> Memory:
    """The memory figures of the cgroup at `directory` (see the module docstring)."""
    if version == 1:
        return Memory(memory_limit(directory, 1), number(os.path.join(directory, "memory.max_usage_in_bytes")),
                      keyed(os.path.join(directory, "memory.oom_control"), "oom_kill"))
    return Memory(memory_limit(directory, 2, top), number(os.path.join(directory, "memory.peak")),
                  keyed(os.path.join(directory, "memory.events"), "oom_kill"))


def cpu_seconds(directory: str, version: int) -> float | None:
    """CPU time every process of the cgroup has used (v1: `directory` in the cpuacct hierarchy)."""
    if version == 1:
        ns = number(os.path.join(directory, "cpuacct.usage"))
        return None if ns is None else ns / 1e9
    usec = keyed(os.path.join(directory, "cpu.stat"), "usage_usec")
    return None if usec is None else usec / 1e6


def cpu_quota(directory: str, version: int) -> float | None:
    """CPUs the cgroup at `directory` may use by its CFS quota (quota / period); None without one."""
    if version == 1:
        quota = number(os.path.join(directory, "cpu.cfs_quota_us"))        # -1 (no quota) reads as None
        period = number(os.path.join(directory, "cpu.cfs_period_us"))
    else:
        quota, _, period = read_text(os.path.join(directory, "cpu.max")).strip().partition(" ")
        quota, period = (int(quota), int(period)) if quota.isdigit() and period.isdigit() else (None, None)
    return quota / period if quota and period else None


def own_cpu_quota(mount_list: list[Mount] | None = None, proc: str = "/proc") -> float | None:
    """The CPUs this process's cgroup quota allows (a device of the edge testbed, a container given
    --cpus), or None where no quota applies."""
    mount_list = mounts() if mount_list is None else mount_list
    directory = process_dir("cpu", "self", mount_list, proc)
    m = controller_mount("cpu", mount_list)
    return None if directory is None or m is None else cpu_quota(directory, m.version)


def own_memory(mount_list: list[Mount] | None = None, proc: str = "/proc") -> Memory | None:
    """This process's memory cgroup figures when a memory limit applies to it; else None."""
    mount_list = mounts() if mount_list is None else mount_list
    directory = process_dir("memory", "self", mount_list, proc)
    if directory is None:
        return None
    m = controller_mount("memory", mount_list)
    figures = memory(directory, m.version, m.point)
    return figures if figures.limit is not None else None
