"""This process's resident memory and what the host can still give, from Linux's /proc files
(what the planner's device profile records as a rank's baseline and budget)."""
from __future__ import annotations

import os


def rss_mib() -> float:
    """The process's resident memory now (Linux /proc; 0 where it cannot be read)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


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
