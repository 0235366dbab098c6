"""Pipeline schedules by name, from torch.distributed.pipelining.

  gpipe  all forwards, then all backwards (fill-drain): activations of every micro-batch live at once
  1f1b   after a warm-up, one forward then one backward: at most pp micro-batches in flight

scale_grads is off: the loss function already scales each micro-batch's loss so that the losses
add up to the global-batch mean (galaxy.parallel.loss_scale), which dividing the gradients by the
number of micro-batches would undo.
"""
from __future__ import annotations

from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

from galaxy.plan import SCHEDULES as PIPELINE_SCHEDULES

SCHEDULES = dict(zip(PIPELINE_SCHEDULES, (ScheduleGPipe, Schedule1F1B), strict=True))


def schedule_class(name: str):
    """The torch schedule named `name`; ValueError naming the known ones otherwise."""
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ValueError(f"pipeline_schedule {name!r} is unknown; use one of {sorted(SCHEDULES)}") from None


def make_schedule(name: str, stage, num_microbatches: int, loss_fn):
    return schedule_class(name)(stage, num_microbatches, loss_fn=loss_fn, scale_grads=False)
