"""One testbed: a run's cgroups and network brought up, its ranks run, everything taken down.

    with Testbed(cluster, layout, run) as bed:     # up: cgroups, then bridge, namespaces, links
        statuses = bed.run_ranks(command, console, grace_s, stop)
                                                   # down: processes killed, links, namespaces,
                                                   # bridge, cgroups removed, state file last
The cgroups come first: on a v2 host they need the root's controllers, the one step that may fail
for a reason of the host's, and nothing else exists yet when it does.
"""
from __future__ import annotations

import os
import time

from galaxy.edge import cgroups, runs
from galaxy.edge.cgroups import DeviceCgroup, Layout
from galaxy.edge.clean import Leftovers, remove
from galaxy.edge.cluster import Cluster
from galaxy.edge.network import Network, netns_name
from galaxy.edge.output import Console
from galaxy.edge.ranks import RENDEZVOUS_PORT, rank_argv, start_rank
from galaxy.edge.supervisor import StopRequest, Supervisor, mib


class Testbed:
    def __init__(self, cluster: Cluster, layout: Layout, run: runs.Run):
        self.cluster, self.layout, self.run = cluster, layout, run
        self.network = Network(run.name, cluster.devices, run.subnet)
        self.cgroups = [DeviceCgroup(layout, run.name, i, d) for i, d in enumerate(cluster.devices)]
        self.ranks = []
        self.up_s = self.down_s = None
        self.problems: list[str] = []            # what down() could not remove

    @property
    def init_method(self) -> str:
        return f"tcp://{self.network.address(0)}:{RENDEZVOUS_PORT}"

    def __enter__(self) -> Testbed:
        t0 = time.perf_counter()
        try:
            cgroups.make_run_dirs(self.layout, self.run.name)
            for group in self.cgroups:
                group.create()
            self.network.up()
        except BaseException:
            self.problems = self.down()
            raise
        self.up_s = time.perf_counter() - t0
        return self

    def __exit__(self, *exc) -> None:
        self.problems = self.down()

    def down(self) -> list[str]:
        """Remove everything, as `clean` removes a dead run's leftovers (one way for both); one line
        per thing that could not be removed (the state file then stays, for `clean`)."""
        t0 = time.perf_counter()
        made = Leftovers(netns=[n for kind, n in self.network.made if kind == "netns"],
                         links=[n for kind, n in self.network.made if kind != "netns"],
                         cgroups=[p for p in self.layout.run_dirs(self.run.name) if os.path.isdir(p)])
        problems = remove(self.run.name, made)
        self.network.made = []
        self.down_s = time.perf_counter() - t0
        return problems

    def run_ranks(self, command: list[str], console: Console, grace_s: float, stop: StopRequest) -> list[int]:
        """Start a rank on every device, watch them to the end; every rank's exit status."""
        world = len(self.cluster.devices)
        for i, (device, group) in enumerate(zip(self.cluster.devices, self.cgroups)):
            argv = rank_argv(command, world, i, self.init_method)
            self.ranks.append(start_rank(i, device, group, netns_name(self.run.name, i), argv))
        Supervisor(self.ranks, console, grace_s, stop).watch()
        return [r.status for r in self.ranks]

    def report(self) -> list[str]:
        """One line per device: exit status, peak memory and CPU time (from its cgroups)."""
        lines = []
        for rank in self.ranks:
            figures, cpu = rank.cgroup.memory(), rank.cgroup.cpu_seconds()
            cpu_text = "?" if cpu is None else f"{cpu:.1f}"
            lines.append(f"{rank.label}: exit {rank.status}, peak memory {mib(figures.peak)} of "
                         f"{rank.device.memory_mib} MiB, CPU time {cpu_text} s")
        return lines
