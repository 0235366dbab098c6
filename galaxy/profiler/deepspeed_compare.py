"""--compare-deepspeed: deepspeed's flops profiler on the same forward, for a side-by-side total."""
from __future__ import annotations

import torch


def deepspeed_forward_flops(model, batch: dict) -> int:
    """Forward FLOPs as deepspeed's FlopsProfiler counts them (its own conventions)."""
    from deepspeed.profiling.flops_profiler import FlopsProfiler
    prof = FlopsProfiler(model)
    prof.start_profile()
    try:
        with torch.no_grad():
            model(**batch)
        return int(prof.get_total_flops())
    finally:
        prof.end_profile()
