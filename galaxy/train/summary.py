"""The end-of-training summary: steps, wall time, throughput, and every rank's peak memory."""
from __future__ import annotations

import resource
import sys

import torch

from galaxy.distributed.per_device import gather_by_launch_rank
from galaxy.runtime import cgroup
from galaxy.runtime.host_memory import peak_rss_mib


def peak_memory_mib(device: torch.device) -> tuple[float, str]:
    """(MiB, what was measured). CUDA: the most memory tensors ever held on the device. CPU: the
    peak of the rank's cgroup where a cgroup limits its memory (what the kernel holds it to: a
    device of the edge testbed, a container), else the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "GPU"
    limited = cgroup.own_memory()
    if limited is not None and limited.peak is not None:
        return limited.peak / 2**20, "cgroup"
    peak = peak_rss_mib()          # Linux: this program's own peak, not its parent's (see there)
    if peak is not None:
        return peak, "RSS"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return (peak / 2**20 if sys.platform == "darwin" else peak / 2**10), "RSS"   # bytes on macOS, KiB elsewhere


def gather_peak_memory(device: torch.device, launch_rank: int) -> tuple[list[float], list[str]]:
    """Collective over the default group: ([MiB of launch rank 0, 1, ...], [what each measured]) on
    every rank: per device, as the user started them (galaxy.distributed.per_device)."""
    mib, source = peak_memory_mib(device)
    every = gather_by_launch_rank((round(mib, 1), source), launch_rank)
    return [m for m, _ in every], [s for _, s in every]


PEAK_LABELS = {"GPU": "peak GPU memory allocated", "RSS": "peak RSS", "cgroup": "peak memory of each rank's cgroup",
               "mixed": "peak memory (the rank's cgroup's where one limits it, else RSS)"}


def format_summary(summary: dict, device: torch.device) -> str:
    kinds = set(summary.get("peak_memory_of", ())) or {"GPU" if device.type == "cuda" else "RSS"}
    what = PEAK_LABELS[kinds.pop() if len(kinds) == 1 else "mixed"]
    lines = [f"done: {summary['steps']} steps ({summary['steps_this_run']} in this run) in "
             f"{summary['wall_s']:.1f} s, {summary['tokens_per_s']:.0f} tokens/s (non-padding), "
             f"final loss {summary['final_loss']:.4f}"]
    for split in ("dev", "test"):
        if f"{split}_accuracy" in summary:
            lines.append(f"{split}: loss {summary[f'{split}_loss']:.4f}, "
                         f"accuracy {summary[f'{split}_accuracy']:.4f}")
    memory = ", ".join(f"rank {r} {m:.0f}" for r, m in enumerate(summary["peak_memory_mib"]))
    lines.append(f"{what} (MiB): {memory}")
    return "\n".join(lines)
