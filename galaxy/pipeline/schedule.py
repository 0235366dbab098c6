"""Pipeline schedules by name.

  gpipe  all forwards, then all backwards (fill-drain): activations of every micro-batch live at once
  1f1b   after a warm-up, one forward then one backward: at most pp micro-batches in flight

Over gloo (CPU) the schedules are Galaxy's (galaxy.pipeline.overlap_schedule): torch's order of
computation, with receives posted at the step's start and sends waited for at its end, so that
transfers overlap compute. Over other backends (NCCL) they are torch.distributed.pipelining's.
GALAXY_PP_ENGINE=torch picks torch's everywhere (benches compare the two engines side by side;
it is not a user setting). Warm-ups per stage (plan.warmup) run on Galaxy's 1f1b only: torch's
schedules fix them at pp - p, so a plan with them refuses the others (launch refuses it on a
backend other than gloo before any process group starts).

scale_grads is off: the loss function already scales each micro-batch's loss so that the losses
add up to the global-batch mean (galaxy.parallel.loss_scale), which dividing the gradients by the
number of micro-batches would undo.
"""
from __future__ import annotations

import os

import torch.distributed as dist
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

from galaxy.pipeline.overlap_schedule import Overlapped1F1B, OverlappedGPipe
from galaxy.plan import SCHEDULES as PIPELINE_SCHEDULES

TORCH = dict(zip(PIPELINE_SCHEDULES, (ScheduleGPipe, Schedule1F1B), strict=True))
OVERLAPPED = dict(zip(PIPELINE_SCHEDULES, (OverlappedGPipe, Overlapped1F1B), strict=True))
ENGINE_VARIABLE = "GALAXY_PP_ENGINE"


def overlapped_engine(backend: str) -> bool:
    """Whether a pp group on `backend` runs Galaxy's engine (gloo, unless GALAXY_PP_ENGINE=torch)."""
    return backend == "gloo" and os.environ.get(ENGINE_VARIABLE, "galaxy") != "torch"


def schedule_class(name: str, backend: str = "gloo", warmups: tuple[int, ...] | None = None):
    """The schedule class named `name` for a pp group on `backend`; ValueError naming the known
    names otherwise, or when `warmups` (plan.warmup) are set for a schedule that cannot run them."""
    if name not in TORCH:
        raise ValueError(f"pipeline_schedule {name!r} is unknown; use one of {sorted(TORCH)}")
    cls = (OVERLAPPED if overlapped_engine(backend) else TORCH)[name]
    if warmups is not None and cls is not Overlapped1F1B:
        raise ValueError(f"pipeline_warmup_list needs Galaxy's 1f1b engine (pipeline_schedule 1f1b, backend gloo, "
                         f"{ENGINE_VARIABLE} not torch) but this pipeline runs torch's {cls.__name__}; remove "
                         f"pipeline_warmup_list to run it")
    return cls


def make_schedule(name: str, stage, num_microbatches: int, loss_fn, warmups: tuple[int, ...] | None = None):
    """warmups: 1f1b's forwards before the first backward, one per stage (None: pp - p)."""
    cls = schedule_class(name, dist.get_backend(stage.group), warmups)
    extra = {} if warmups is None else {"warmups": warmups}
    return cls(stage, num_microbatches, loss_fn=loss_fn, scale_grads=False, **extra)
