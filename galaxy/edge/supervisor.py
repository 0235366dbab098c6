"""Watching the ranks of a run: their output, their ends, a device killed for memory, hung ranks.

One loop (no threads: the ranks are started with a preexec function, which threads make unsafe)
reads every rank's stdout and stderr into the Console and notices ranks that end. When a rank
fails, the others get `grace_s` to stop by themselves (Galaxy's ranks do, within timeout_s, when a
peer dies); whoever still runs then is taken as hung and stopped. A Ctrl-C (or SIGTERM, SIGHUP)
to the launcher is passed to every rank as the same signal; ranks still running STOP_WAIT_S later,
or at a second signal, are killed.
"""
from __future__ import annotations

import os
import selectors
import signal
import time
from dataclasses import dataclass

from galaxy.edge.output import Console
from galaxy.edge.ranks import Rank, reap, signal_rank

STOP_WAIT_S = 10.0
# A rank's pipes can outlive it (a child it left holds them): stop reading them this long after.
PIPE_LINGER_S = 2.0
TICK_S = 0.1


@dataclass
class StopRequest:
    """Set by the launcher's signal handlers."""
    signum: int | None = None
    repeated: bool = False

    def handler(self, signum, _frame) -> None:
        self.repeated = self.signum is not None
        self.signum = self.signum or signum


def mib(n_bytes: int | None) -> str:
    return "?" if n_bytes is None else f"{n_bytes / 2 ** 20:.0f}"


def memory_note(rank: Rank) -> str | None:
    """The line for a rank whose device ran out of memory, else None."""
    figures = rank.cgroup.memory()
    if not figures.oom_kills:
        return None
    what = "was killed" if rank.status == 128 + signal.SIGKILL else "lost a process"
    return (f"{rank.label} {what}: out of memory, limit {rank.device.memory_mib} MiB, "
            f"peak {mib(figures.peak)} MiB")


class Supervisor:
    def __init__(self, ranks: list[Rank], console: Console, grace_s: float, stop: StopRequest):
        self.ranks, self.console, self.grace_s, self.stop = ranks, console, grace_s, stop
        self.selector = selectors.DefaultSelector()
        for rank in ranks:
            for stream, pipe in (("out", rank.proc.stdout), ("err", rank.proc.stderr)):
                os.set_blocking(pipe.fileno(), False)
                self.selector.register(pipe, selectors.EVENT_READ, (rank, stream))
        self.first_failure: Rank | None = None
        self.kill_at: float | None = None       # when ranks still running get SIGKILL
        self.forwarded = False

    def running(self) -> list[Rank]:
        return [r for r in self.ranks if r.status is None]

    def watch(self) -> None:
        """Until every rank has ended and its output is read."""
        while self.running() or self.selector.get_map():
            for key, _ in self.selector.select(TICK_S):
                self._pump(key.fileobj, *key.data)
            for rank in self.ranks:
                if reap(rank):
                    self._ended(rank)
            self._drop_stale_pipes()
            self._stop_if_due()
        self.selector.close()

    def _pump(self, pipe, rank: Rank, stream: str) -> None:
        try:
            data = os.read(pipe.fileno(), 1 << 16)
        except BlockingIOError:
            return
        self.console.feed(rank.index, stream, data)
        if not data:
            self.selector.unregister(pipe)
            pipe.close()

    def _ended(self, rank: Rank) -> None:
        note = memory_note(rank)
        if note:
            self.console.note(f"galaxy.edge: {note}")
        if rank.status != 0 and self.first_failure is None and self.stop.signum is None:
            self.first_failure = rank
            if self.running():
                self.console.note(f"galaxy.edge: {rank.label} exited {rank.status}; the other ranks get "
                                  f"--grace_s {self.grace_s:g} s to stop")

    def _drop_stale_pipes(self) -> None:
        now = time.monotonic()
        for key in list(self.selector.get_map().values()):
            rank, stream = key.data
            if rank.ended is not None and now - rank.ended > PIPE_LINGER_S:
                self.console.feed(rank.index, stream, b"")
                self.selector.unregister(key.fileobj)
                key.fileobj.close()

    def _stop_if_due(self) -> None:
        now, running = time.monotonic(), self.running()
        if not running:
            return
        if self.stop.signum is not None and not self.forwarded:
            self.forwarded, self.kill_at = True, now + STOP_WAIT_S
            self.console.note(f"galaxy.edge: {signal.Signals(self.stop.signum).name}: stopping the ranks")
            for rank in running:
                signal_rank(rank, self.stop.signum)
        failed = self.first_failure
        if failed is not None and self.kill_at is None and now - failed.ended > self.grace_s:
            self.kill_at = now
            names = ", ".join(r.label for r in running)
            self.console.note(f"galaxy.edge: {names} still running {self.grace_s:g} s after {failed.label} "
                              f"failed: taken as hung, killing")
        if self.kill_at is not None and (now >= self.kill_at or self.stop.repeated):
            for rank in running:
                signal_rank(rank, signal.SIGKILL)
