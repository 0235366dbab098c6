"""A cgroup per device: its CPU share (CFS quota) and its memory limit without swap, v1 or v2.

Layout, under the root of each hierarchy the testbed uses:

    v1:  /sys/fs/cgroup/{cpu,cpuacct,memory}/gxe-1a2b3c/0-laptop     (one folder per hierarchy)
    v2:  /sys/fs/cgroup/gxe-1a2b3c/0-laptop

At the root, not under the launcher's own cgroup: in v2 a cgroup that holds a process cannot hand
controllers down to children (the root is exempt), and `clean` finds every run's folder in one
place. A rank joins its device's cgroups before it execs (galaxy.edge.ranks), so everything it
starts is counted and limited. Figures are read with galaxy.runtime.cgroup.
"""
from __future__ import annotations

import errno
import os
import signal
import time
from dataclasses import dataclass

from galaxy.edge.cluster import Device
from galaxy.edge.shell import EdgeError
from galaxy.runtime import cgroup

# CFS period: 10 ms rather than the kernel's 100 ms, so that a device is slow at the time scale of
# a sub-block (a few ms) instead of running at full speed for cpus x 100 ms and then stopping.
PERIOD_US = 10_000
# CPU weight: the run's folder gets the most the kernel allows, so that on a busy host the devices
# still get their shares (the quotas keep the testbed to the sum of its devices' cpus); devices
# weigh in proportion to their cpus, so that when even that falls short they shrink alike.
RUN_WEIGHT = {1: ("cpu.shares", 262144), 2: ("cpu.weight", 10000)}
DEVICE_WEIGHT_PER_CPU = {1: 1024, 2: 100}          # the kernel's default weight, per core
V1_CONTROLLERS = ("cpu", "cpuacct", "memory")
V2_CONTROLLERS = ("cpu", "memory")
KILL_WAIT_S = 5.0


@dataclass(frozen=True)
class Layout:
    version: int
    roots: dict             # controller -> mount point of its hierarchy (v2: the same for all)

    def run_dirs(self, run_name: str) -> list[str]:
        """The run's folder in every hierarchy (v1 with cpu and cpuacct mounted together: once)."""
        return sorted({os.path.join(root, run_name) for root in self.roots.values()})


def find_layout(mount_list: list[cgroup.Mount] | None = None) -> Layout | str:
    """The hierarchies to use, or one line saying what the host lacks."""
    mount_list = cgroup.mounts() if mount_list is None else mount_list
    v1 = {c: cgroup.controller_mount(c, mount_list) for c in V1_CONTROLLERS}
    if all(m is not None and m.version == 1 for m in v1.values()):
        return Layout(1, {c: m.point for c, m in v1.items()})
    v2 = [m for m in mount_list if m.version == 2 and set(V2_CONTROLLERS) <= m.controllers]
    if v2:
        return Layout(2, {c: v2[0].point for c in V2_CONTROLLERS})
    have = sorted({c for m in mount_list for c in m.controllers})
    return ("no cgroup hierarchy offers the cpu, cpuacct and memory controllers (v1) or cpu and memory (v2); "
            f"mounted: {', '.join(have) or 'none'}")


def write(path: str, value) -> None:
    try:
        with open(path, "w", encoding="ascii") as f:
            f.write(str(value))
    except OSError as e:
        raise EdgeError(f"cannot write {value!r} to {path}: {e.strerror}") from None


def make_run_dirs(layout: Layout, run_name: str) -> None:
    """The run's folders; in v2 with the cpu and memory controllers handed down to the devices."""
    for path in layout.run_dirs(run_name):
        if layout.version == 2:
            enable_controllers(os.path.dirname(path))
        try:
            os.mkdir(path)
        except OSError as e:
            raise EdgeError(f"cannot make the cgroup {path}: {e.strerror}") from None
        if layout.version == 2:
            enable_controllers(path)
    name, weight = RUN_WEIGHT[layout.version]
    write(os.path.join(layout.roots["cpu"], run_name, name), weight)


def enable_controllers(path: str) -> None:
    on = set(cgroup.read_text(os.path.join(path, "cgroup.subtree_control")).split())
    wanted = [c for c in V2_CONTROLLERS if c not in on]
    if wanted:
        write(os.path.join(path, "cgroup.subtree_control"), " ".join(f"+{c}" for c in wanted))


class DeviceCgroup:
    """Device `index`'s cgroup in every hierarchy of the layout."""

    def __init__(self, layout: Layout, run_name: str, index: int, device: Device):
        self.layout, self.device = layout, device
        leaf = f"{index}-{device.name}"
        self.dirs = {c: os.path.join(root, run_name, leaf) for c, root in layout.roots.items()}

    def create(self) -> None:
        for path in sorted(set(self.dirs.values())):
            try:
                os.mkdir(path)
            except OSError as e:
                raise EdgeError(f"cannot make the cgroup {path}: {e.strerror}") from None
        quota = round(self.device.cpus * PERIOD_US)
        limit = self.device.memory_mib * 2 ** 20
        cpu, mem = self.dirs["cpu"], self.dirs["memory"]
        weight = max(2, round(self.device.cpus * DEVICE_WEIGHT_PER_CPU[self.layout.version]))
        write(os.path.join(cpu, RUN_WEIGHT[self.layout.version][0]), weight)
        if self.layout.version == 1:
            write(os.path.join(cpu, "cpu.cfs_period_us"), PERIOD_US)
            write(os.path.join(cpu, "cpu.cfs_quota_us"), quota)
            write(os.path.join(mem, "memory.limit_in_bytes"), limit)
            # No swap: memory + swap limited to the memory limit, where swap accounting is on.
            if os.path.exists(os.path.join(mem, "memory.memsw.limit_in_bytes")):
                write(os.path.join(mem, "memory.memsw.limit_in_bytes"), limit)
            else:
                write(os.path.join(mem, "memory.swappiness"), 0)
        else:
            write(os.path.join(cpu, "cpu.max"), f"{quota} {PERIOD_US}")
            write(os.path.join(mem, "memory.max"), limit)
            if os.path.exists(os.path.join(mem, "memory.swap.max")):
                write(os.path.join(mem, "memory.swap.max"), 0)

    def procs_files(self) -> list[str]:
        """What a process writes its pid to, to join (one per distinct folder)."""
        return [os.path.join(d, "cgroup.procs") for d in sorted(set(self.dirs.values()))]

    def memory(self) -> cgroup.Memory:
        return cgroup.memory(self.dirs["memory"], self.layout.version, self.layout.roots["memory"])

    def cpu_seconds(self) -> float | None:
        return cgroup.cpu_seconds(self.dirs["cpuacct" if self.layout.version == 1 else "cpu"], self.layout.version)


def pids_in(path: str) -> set[int]:
    """Every process in the cgroup at `path` and the cgroups below it."""
    pids = set()
    for folder, _, _ in os.walk(path):
        pids |= {int(p) for p in cgroup.read_text(os.path.join(folder, "cgroup.procs")).split()}
    return pids


def kill_all(path: str) -> None:
    """SIGKILL every process in the cgroup tree at `path` and wait until none is left (forks that
    race the kill are caught by the next round)."""
    deadline = time.monotonic() + KILL_WAIT_S
    while True:
        pids = pids_in(path)
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)


def remove_tree(path: str) -> list[str]:
    """Kill what runs in the cgroup tree at `path` and remove its folders, deepest first.
    Returns one line per folder that could not be removed."""
    if not os.path.isdir(path):
        return []
    kill_all(path)
    problems = []
    for folder, _, _ in sorted(os.walk(path), key=lambda entry: -entry[0].count(os.sep)):
        for attempt in range(50):       # a killed process leaves its cgroup a moment after it dies
            try:
                os.rmdir(folder)
                break
            except OSError as e:
                if e.errno == errno.ENOENT:
                    break
                if e.errno != errno.EBUSY or attempt == 49:
                    problems.append(f"cannot remove the cgroup {folder}: {e.strerror}")
                    break
                time.sleep(0.02)
    return problems
