"""`run --shield`: the rest of the host's processes in a low-weight cpu cgroup while a run lasts.

A run's folder already gets the most CPU weight the kernel allows (galaxy.edge.cgroups), but on a
busy host the other processes still take their turns on the cores, and a run's step times move
with them (runs of one plan 1.0-1.7x apart on this project's 2-core VM beside other work). With
--shield, every process of the host that sits in the root cpu cgroup is moved, for as long as the
run lasts, into a cgroup of the least weight (v1 cpu.shares 2, v2 cpu.weight 1), so that it runs
only on what the testbed's devices leave; the root is scanned again every SCAN_S seconds, so
processes started meanwhile follow. They keep running (nothing is stopped or killed) and go back
to the root cgroup when the run ends, and so does everything a dead launcher's shield still holds
(`clean`).

Only the root cgroup's processes move: a process the host's service manager put in a cgroup of its
own (a systemd slice) stays there; kernel threads cannot move and are skipped. The launcher stays
where it is: it relays the ranks' output and stops them. The shield is named after its run
(gxs-<the run's hex>), not gxe-...: `clean` kills what runs in a dead run's folders, and a shield
holds the host's own processes, which it must hand back alive.
"""
from __future__ import annotations

import errno
import os
import re
import threading
import time

from galaxy.edge import runs
from galaxy.edge.cgroups import Layout, enable_controllers, write
from galaxy.edge.shell import EdgeError
from galaxy.runtime import cgroup

PREFIX = "gxs-"
SHIELD_NAME = re.compile(rf"^{PREFIX}([0-9a-f]{{6}})$")
WEIGHT = {1: ("cpu.shares", 2), 2: ("cpu.weight", 1)}
SCAN_S = 1.0
# Set to 1, every `run` shields itself without --shield (benches that start the testbed themselves).
SHIELD_ENV = "GALAXY_EDGE_SHIELD"


def shield_name(run_name: str) -> str:
    return PREFIX + run_name.removeprefix(runs.PREFIX)


def run_of_shield(folder_name: str) -> str | None:
    """The run a shield folder belongs to (gxs-1a2b3c -> gxe-1a2b3c), or None."""
    m = SHIELD_NAME.match(folder_name)
    return runs.PREFIX + m.group(1) if m else None


def pids(path: str) -> list[int]:
    return [int(p) for p in cgroup.read_text(os.path.join(path, "cgroup.procs")).split()]


def move(pid_list, into: str) -> int:
    """Move each process into the cgroup at `into`; how many moved (kernel threads refuse, and
    processes that ended meanwhile are gone)."""
    moved = 0
    for pid in pid_list:
        try:
            with open(os.path.join(into, "cgroup.procs"), "w", encoding="ascii") as f:
                f.write(str(pid))
            moved += 1
        except OSError:
            continue
    return moved


def release(path: str, root: str) -> list[str]:
    """Every process of the shield at `path` back to the root cgroup `root`, then the folder
    removed; one line per thing that stayed."""
    for _ in range(50):             # a process forked during the move joins the shield: go again
        if not move(pids(path), root) and not pids(path):
            break
    for attempt in range(50):
        try:
            os.rmdir(path)
            return []
        except OSError as e:
            if e.errno == errno.ENOENT:
                return []
            if e.errno != errno.EBUSY or attempt == 49:
                return [f"cannot remove the shield cgroup {path}: {e.strerror}"]
            move(pids(path), root)
            time.sleep(0.02)
    return []


class Shield:
    """While open, the root cpu cgroup's processes (but this one) sit in the run's shield."""

    def __init__(self, layout: Layout, run_name: str):
        self.root = layout.roots["cpu"]
        self.version = layout.version
        self.path = os.path.join(self.root, shield_name(run_name))
        self.moved = 0                                     # processes moved, over the run
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._scan, name="galaxy.edge shield", daemon=True)
        self.problems: list[str] = []

    def __enter__(self) -> Shield:
        if self.version == 2:
            enable_controllers(self.root)
        try:
            os.mkdir(self.path)
        except OSError as e:
            raise EdgeError(f"cannot make the shield cgroup {self.path}: {e.strerror}") from None
        name, weight = WEIGHT[self.version]
        write(os.path.join(self.path, name), weight)
        self._sweep()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.problems = release(self.path, self.root)

    def _sweep(self) -> None:
        me = os.getpid()
        self.moved += move([p for p in pids(self.root) if p != me], self.path)

    def _scan(self) -> None:
        while not self._stop.wait(SCAN_S):
            self._sweep()


def leftover_shields(layout: Layout | str) -> dict[str, str]:
    """run name -> its shield folder, for every shield at the cpu hierarchy's root."""
    if not isinstance(layout, Layout):
        return {}
    root = layout.roots["cpu"]
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return {}
    return {run_of_shield(n): os.path.join(root, n) for n in names if run_of_shield(n)}
