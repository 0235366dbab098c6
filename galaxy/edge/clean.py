"""`clean`: remove what testbeds whose launcher died (a SIGKILL, a power-cut shell) left behind.

Everything a run makes is named gxe-<hex>... (galaxy.edge.runs): namespaces in `ip netns`, the
bridge and the host ends of the veth pairs in `ip link`, a folder at the root of each cgroup
hierarchy. Runs whose launcher still lives are left alone, so `clean` is safe beside a running
testbed. Their processes are killed first (a namespace with a process in it outlives its name).
A dead run's shield (run --shield, galaxy.edge.shield) holds the host's own processes: they are
moved back to the root cgroup, not killed.
"""
from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field

from galaxy.edge import cgroups, runs
from galaxy.edge.cgroups import Layout
from galaxy.edge.network import bridge_name
from galaxy.edge.shell import EdgeError, run, undo
from galaxy.edge.shield import leftover_shields, release


@dataclass
class Leftovers:
    netns: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)
    cgroups: list[str] = field(default_factory=list)     # run folders
    state: bool = False                                   # a state file

    def __str__(self) -> str:
        parts = [f"{len(self.netns)} namespaces", f"{len(self.links)} links", f"{len(self.cgroups)} cgroup folders"]
        return ", ".join(parts) + (", its state file" if self.state else "")


def netns_names() -> list[str]:
    try:
        return [line.split()[0] for line in run("ip", "netns", "list").splitlines() if line.strip()]
    except EdgeError:
        return []


def link_names() -> list[str]:
    """Host link names (`ip -o link` lines read "3: name@peer: <...>")."""
    try:
        lines = run("ip", "-o", "link", "show").splitlines()
    except EdgeError:
        return []
    return [line.split(": ", 2)[1].split("@")[0] for line in lines if line.count(": ") >= 2]


def cgroup_dirs(layout: Layout | str) -> list[str]:
    if not isinstance(layout, Layout):
        return []
    found = []
    for root in sorted(set(layout.roots.values())):
        try:
            found += [os.path.join(root, n) for n in sorted(os.listdir(root)) if runs.run_of(n)]
        except OSError:
            continue
    return found


def find(layout: Layout | str, recorded: list[runs.Run]) -> dict[str, Leftovers]:
    """run name -> what it left, for every run found by name or by state file."""
    found: dict[str, Leftovers] = {}
    for name in netns_names():
        if runs.run_of(name):
            found.setdefault(runs.run_of(name), Leftovers()).netns.append(name)
    for name in link_names():
        if runs.run_of(name):
            found.setdefault(runs.run_of(name), Leftovers()).links.append(name)
    for path in cgroup_dirs(layout):
        found.setdefault(runs.run_of(os.path.basename(path)), Leftovers()).cgroups.append(path)
    for r in recorded:
        found.setdefault(r.name, Leftovers()).state = True
    return found


def kill_in_netns(name: str) -> None:
    try:
        pids = run("ip", "netns", "pids", name).split()
    except EdgeError:
        return
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def remove(name: str, left: Leftovers) -> list[str]:
    """Remove a run's things: processes, then links (host ends before the bridge: deleting a host
    end removes both ends at once, while a deleted namespace frees its end only later, in the
    kernel's own time), namespaces, cgroups, and the state file when nothing stayed. One line per
    thing that stayed. The launcher's own teardown and `clean` both end here."""
    for path in left.cgroups:
        cgroups.kill_all(path)
    for ns in left.netns:
        kill_in_netns(ns)
    problems = []
    for link in sorted(left.links, key=lambda n: n == bridge_name(name)):
        problems.append(undo("ip", "link", "del", link))
    for ns in left.netns:
        problems.append(undo("ip", "netns", "del", ns))
    for path in left.cgroups:
        problems += cgroups.remove_tree(path)
    problems = [p for p in problems if p]
    if not problems:
        runs.forget(name)
    return problems


def clean(layout: Layout | str, note) -> int:
    """Remove every dead run's leftovers, note(line) for each run; exit status (1: something stayed)."""
    with runs.locked():
        recorded = runs.read_runs()
        live = {r.name: r for r in recorded if runs.is_live(r)}
        found = find(layout, recorded)
    status = 0
    for name, left in sorted(found.items()):
        if name in live:
            note(f"left alone {name}: its launcher (pid {live[name].pid}) is running")
            continue
        problems = remove(name, left)
        for line in problems:
            note(f"{name}: {line}")
        status = 1 if problems else status
        note(f"{'removed' if not problems else 'partly removed'} {name}: {left}")
    for name, path in sorted(leftover_shields(layout).items()):
        if name in live:
            note(f"left alone {path}: the shield of {name}, whose launcher (pid {live[name].pid}) is running")
            continue
        problems = release(path, layout.roots["cpu"])
        for line in problems:
            note(f"{name}: {line}")
        status = 1 if problems else status
        note(f"{'released' if not problems else 'partly released'} {path}: its processes are back in the root cgroup")
    if not found and not leftover_shields(layout):
        note("nothing to clean")
    return status
