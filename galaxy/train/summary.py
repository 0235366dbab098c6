"""The end-of-training summary: steps, wall time, throughput, and every rank's peak memory."""
from __future__ import annotations

import resource
import sys

import torch
import torch.distributed as dist


def peak_memory_mib(device: torch.device) -> float:
    """CUDA: the most memory tensors ever held on the device. CPU: the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10   # bytes on macOS, KiB on Linux


def gather_peak_memory(device: torch.device) -> list[float]:
    """Collective over the default group: [MiB of rank 0, rank 1, ...] on every rank."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, round(peak_memory_mib(device), 1))
    return every


def format_summary(summary: dict, device: torch.device) -> str:
    what = "peak GPU memory allocated" if device.type == "cuda" else "peak RSS"
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
