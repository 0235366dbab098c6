"""python -m galaxy.edge run|check|clean: see galaxy/edge/__init__.py and docs/edge.md.

Exit status: `run` returns the worst exit status of its ranks (128 + N for a rank ended by signal
N; 128 + N too when the launcher itself was stopped by signal N, e.g. 130 for Ctrl-C), 2 for a
mistake in the cluster file or the command line or a host that cannot run the testbed (one line
each, before anything is made), 1 when the testbed could not be built or fully removed. `check`:
0 when the file is valid (what the host lacks is listed, not fatal), else 2. `clean`: 0, or 1 when
something could not be removed.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import sys

from galaxy.config import ConfigError
from galaxy.edge import clean as cleaning
from galaxy.edge import host, runs
from galaxy.edge.cgroups import PERIOD_US, Layout, find_layout
from galaxy.edge.cluster import Cluster, load_cluster
from galaxy.edge.network import Network, host_networks, pick_subnet
from galaxy.edge.output import Console
from galaxy.edge.ranks import RENDEZVOUS_PORT, rank_argv
from galaxy.edge.shell import EdgeError
from galaxy.edge.shield import SHIELD_ENV, Shield
from galaxy.edge.supervisor import StopRequest
from galaxy.edge.testbed import Testbed

PROG = "python -m galaxy.edge"
# Galaxy's default timeout_s (120 s) plus time to start: a rank whose peer died has reported it by then.
DEFAULT_GRACE_S = 180.0


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def parse_args(argv):
    p = _Parser(prog=PROG, description="Run a command on emulated devices: one rank per device, each in its own "
                                       "network namespace with a shaped link, a CPU share and a memory limit.")
    sub = p.add_subparsers(dest="action", required=True, parser_class=_Parser)
    run_p = sub.add_parser("run", help="build the testbed, run COMMAND as every device's rank, remove the testbed")
    check_p = sub.add_parser("check", help="print what `run` would build, and what this host lacks; needs no root")
    sub.add_parser("clean", help="remove what testbeds whose launcher died left behind")
    for q in (run_p, check_p):
        q.add_argument("--cluster", required=True, metavar="FILE", help="cluster file, e.g. clusters/home3.json")
        q.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                       help="what every device runs; --world, --rank and --init_method are appended")
    run_p.add_argument("--grace_s", type=float, default=DEFAULT_GRACE_S, metavar="S",
                       help=f"after a rank fails, seconds the others get to stop by themselves before they "
                            f"are killed as hung (default {DEFAULT_GRACE_S:g})")
    # GALAXY_EDGE_SHIELD=1 shields every run a shell starts, the runs benches start themselves included.
    run_p.add_argument("--shield", action="store_true", default=os.environ.get(SHIELD_ENV) == "1",
                       help="while the run lasts, move the host's other processes (those in the root cpu cgroup) "
                            f"into a cgroup of the least CPU weight, so that they do not disturb its timings "
                            f"(default: on where {SHIELD_ENV}=1)")
    args = p.parse_args(argv)
    if getattr(args, "command", None) and args.command[0] == "--":
        args.command = args.command[1:]
    if args.action == "run" and not args.command:
        p.error("run needs a command after --, e.g. -- python pretrain_galaxy.py --config_file c.json")
    if args.action == "run" and not args.grace_s > 0:
        p.error(f"--grace_s must be greater than 0, got {args.grace_s:g}")
    return args


def error(line: str) -> None:
    sys.stderr.write(f"{PROG}: error: {line}\n")


def load(path: str) -> Cluster | None:
    try:
        return load_cluster(path)
    except ConfigError as e:
        for line in e.problems:
            error(line)
        return None


def run_command(args) -> int:
    cluster = load(args.cluster)
    if cluster is None:
        return 2
    missing = host.missing(cluster)
    if shutil.which(args.command[0]) is None:
        missing.append(f"command not found: {args.command[0]} (what every device runs, after --)")
    for line in missing:
        error(line)
    if missing:
        return 2
    console = Console([d.name for d in cluster.devices], sys.stdout.buffer, sys.stderr.buffer)
    note = lambda line: console.note(f"galaxy.edge: {line}")        # noqa: E731
    for line in cluster.warnings:
        note(f"warning: {line}")
    stop = StopRequest()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop.handler)       # from here on a signal stops the run in order
    statuses, bed = [], None
    try:
        run = runs.new_run()
        bed = Testbed(cluster, find_layout(), run)
        shield = Shield(bed.layout, run.name) if args.shield else contextlib.nullcontext()
        with bed, shield:
            note(f"testbed {run.name} up in {bed.up_s:.2f} s: {len(cluster.devices)} devices on {run.subnet}, "
                 f"rendezvous {bed.init_method}" + (f"; shielded from {shield.moved} other processes" if args.shield else ""))
            if stop.signum is None:
                statuses = bed.run_ranks(args.command, console, args.grace_s, stop)
                for line in bed.report():
                    note(line)
        for line in getattr(shield, "problems", ()):
            note(f"error: {line}")
        note(f"testbed {run.name} down in {bed.down_s:.2f} s")
    except EdgeError as e:
        error(str(e))
        statuses.append(1)
    for line in bed.problems if bed else []:
        note(f"error: {line}")
    if bed and bed.problems:
        note(f"error: run `{PROG} clean` to remove what is left")
        statuses.append(1)
    if stop.signum is not None:
        return 128 + stop.signum
    return max(statuses, default=0)


def check_command(args) -> int:
    cluster = load(args.cluster)
    if cluster is None:
        return 2
    world = len(cluster.devices)
    print(f"{cluster.path}: {world} device{'s' if world > 1 else ''}, one rank each")
    for i, d in enumerate(cluster.devices):
        print(f"  rank {i} {d.name}: cpus {d.cpus:g} (CFS quota {round(d.cpus * PERIOD_US)} us per {PERIOD_US} us), "
              f"{d.threads} torch thread{'s' if d.threads > 1 else ''}, memory {d.memory_mib} MiB without swap, "
              f"link {d.link_mbit:g} Mbit/s" + (f", latency {d.latency_ms:g} ms" if d.latency_ms else "")
              + (f", cpuset {','.join(map(str, d.cpuset))}" if d.cpuset else ""))
    for line in cluster.warnings:
        print(f"warning: {line}")
    live = [r.subnet for r in runs.read_runs() if runs.is_live(r)]
    network = Network(f"{runs.PREFIX}XXXXXX", cluster.devices, pick_subnet(host_networks() + live))
    print("network (the run's name and a /24 free when it starts; for example):")
    for line in network.describe():
        print(f"  {line}")
    layout = find_layout()
    if isinstance(layout, Layout):
        roots = sorted(set(layout.roots.values()))
        print(f"cgroups (v{layout.version}): {', '.join(roots)}, each /{runs.PREFIX}XXXXXX/<rank>-<name>")
    init = f"tcp://{network.address(0)}:{RENDEZVOUS_PORT}"
    if args.command:
        print("commands:")
        for i, d in enumerate(cluster.devices):
            print(f"  {d.name}: OMP_NUM_THREADS={d.threads} {' '.join(rank_argv(args.command, world, i, init))}")
    missing = host.missing(cluster)
    print("host: ready to run it" if not missing else "host: cannot run it here:")
    for line in missing:
        print(f"  {line}")
    return 0


def clean_command(_args) -> int:
    if os.geteuid() != 0:
        error("clean removes namespaces, links and cgroups: run it as root (e.g. sudo)")
        return 2
    return cleaning.clean(find_layout(), lambda line: print(f"galaxy.edge: clean: {line}", flush=True))


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        return {"run": run_command, "check": check_command, "clean": clean_command}[args.action](args)
    except KeyboardInterrupt:           # before `run` takes the signals over
        return 130


if __name__ == "__main__":
    sys.exit(main())
