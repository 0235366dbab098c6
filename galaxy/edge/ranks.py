"""Starting one rank inside its device: its namespace, its host name, its cgroups, its threads.

The rank is the user's command plus `--world N --rank R --init_method tcp://<device 0>:29500`,
the arguments Galaxy's entry scripts take by hand. Between fork and exec the child joins the
device's network namespace (setns), takes a UTS namespace of its own named after the device (so
that Galaxy, which counts ranks per host by host name, sees one rank per device, as on real
boxes), writes its pid into the device's cgroups and, with a cpuset, pins itself; so everything
the command runs is inside the device from its first instruction. Each rank is the leader of its
own session: a Ctrl-C at the terminal reaches the launcher only, which stops the ranks in order.
"""
from __future__ import annotations

import ctypes
import os
import socket
import subprocess
import time
from dataclasses import dataclass

from galaxy.edge.cgroups import DeviceCgroup
from galaxy.edge.cluster import Device
from galaxy.edge.shell import EdgeError

CLONE_NEWNET, CLONE_NEWUTS = 0x40000000, 0x04000000
RENDEZVOUS_PORT = 29500       # free in every run: each device's namespace starts empty
# Variables naming host interfaces name nothing inside a device; Galaxy's launch finds the
# interface that routes to rank 0 (galaxy.distributed.interface), as it does on real machines.
HOST_ONLY_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")

_libc = ctypes.CDLL(None, use_errno=True)


@dataclass
class Rank:
    index: int
    device: Device
    cgroup: DeviceCgroup
    proc: subprocess.Popen
    status: int | None = None           # exit status; 128 + N when signal N ended it
    ended: float | None = None          # time.monotonic() when it ended

    @property
    def label(self) -> str:
        return f"device {self.device.name} (rank {self.index})"


def rank_argv(command: list[str], world: int, rank: int, init_method: str) -> list[str]:
    return [*command, "--world", str(world), "--rank", str(rank), "--init_method", init_method]


def rank_env(device: Device, base: dict | None = None) -> dict:
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in HOST_ONLY_ENV}
    threads = str(device.threads)
    # torch sizes its intra-op pool from OMP_NUM_THREADS; MKL's own pool follows MKL_NUM_THREADS.
    env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, PYTHONUNBUFFERED="1")
    return env


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def enter_device(netns_path: str, hostname: str, procs_files: list[str], cpuset) -> None:
    """Runs in the child between fork and exec (no threads there, so plain calls are safe)."""
    fd = os.open(netns_path, os.O_RDONLY)
    _check(_libc.setns(fd, CLONE_NEWNET), "setns")
    os.close(fd)
    _check(_libc.unshare(CLONE_NEWUTS), "unshare")
    socket.sethostname(hostname)
    for path in procs_files:
        with open(path, "w", encoding="ascii") as f:
            f.write(str(os.getpid()))
    if cpuset:
        os.sched_setaffinity(0, cpuset)


def start_rank(index: int, device: Device, cgroup: DeviceCgroup, netns: str, argv: list[str]) -> Rank:
    netns_path = f"/run/netns/{netns}"
    try:
        proc = subprocess.Popen(
            argv, env=rank_env(device), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=lambda: enter_device(netns_path, device.name, cgroup.procs_files(), device.cpuset))
    except (OSError, subprocess.SubprocessError) as e:
        raise EdgeError(f"cannot start device {device.name}'s rank `{' '.join(argv)}`: {e}") from None
    return Rank(index, device, cgroup, proc)


def exit_status(returncode: int) -> int:
    """A shell's exit status: 128 + N for a process ended by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def signal_rank(rank: Rank, sig: int) -> None:
    """Send sig to the rank's process group (the rank and what it started)."""
    try:
        os.killpg(rank.proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def reap(rank: Rank) -> bool:
    """Record the rank's exit if it has ended; True when it ended just now."""
    if rank.status is not None or rank.proc.poll() is None:
        return False
    rank.status, rank.ended = exit_status(rank.proc.returncode), time.monotonic()
    return True
