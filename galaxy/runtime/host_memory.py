"""This process's resident memory and what the host can still give, from Linux's /proc files
(what the planner's device profile records as a rank's baseline and budget, and the trainer as
its peak)."""
from __future__ import annotations

import os


def _status_mib(field: str) -> float | None:
    """A memory line of /proc/self/status (VmRSS, VmHWM, ...) in MiB; None where it cannot be read."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def rss_mib() -> float:
    """The process's resident memory now (0 where it cannot be read)."""
    return _status_mib("VmRSS") or 0.0


def peak_rss_mib() -> float | None:
    """The process's peak resident memory since it started its program (Linux VmHWM: per address
    space, so it starts afresh at exec, where getrusage's ru_maxrss keeps the parent's peak as a
    floor: ranks a 1.5 GiB bench process started reported 1557 MiB each). None off Linux."""
    return _status_mib("VmHWM")


def available_mib() -> float:
    """Memory the system can give new work (Linux MemAvailable; else physical memory)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 20
