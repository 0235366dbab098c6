"""Pipeline schedules whose sends and receives overlap compute (Galaxy's 1f1b and gpipe engine).

torch.distributed.pipelining's Schedule1F1B waits for its sends before it computes: in steady
state it starts `bwd_sends + fwd_recvs` (then `fwd_sends + bwd_recvs`) as one batch and waits for
all of it, so every activation or gradient send on a slow link is exposed once per micro-batch,
on both ends of the link. Gloo moves a send's bytes only once the receiver has posted its receive
(the receiver tells the sender it is ready), so a receive posted just before the compute that
needs it also exposes the whole transfer.

This engine runs the same computations in the same order as torch's schedule (so every number
is bit-identical), on torch's stage API, with the communication moved:
  - receives: every receive of the step is posted when the step starts. Torch's stage gives each
    micro-batch its own buffers (PipelineStage: args_recv_info[i] for activations,
    grad_recv_info[i] for gradients, allocated once and kept across steps), so no early receive
    overwrites a buffer still in use. Each is waited for just before the compute that reads it;
  - sends: started as soon as their tensor exists (after the forward, or backward, that made it)
    and waited for only when the step ends. Nothing reuses a sent tensor: a forward's output
    stays in the stage's cache until its backward, a gradient is a fresh tensor.
Matching stays right because gloo matches a pair's sends and receives of one tag in the order
they were posted, and both ends post a boundary's micro-batches in order 0..m-1 (an
encoder-decoder's several carry tensors in carry order within each).

Waits are work.wait() (galaxy.distributed.waiting.wait: gloo's sends and receives cannot be
polled), bounded by the process group's timeout as torch's waits are, so a dead peer still stops
this rank with the transport's error.

Measured on the edge testbed's edge4 (MiniLM, micro-batches of [1, 128, 384] fp32, 196 KB each
way; bench/pp_engines.py): the searched [3, 1, 1, 1] x 12 1f1b plan's step 1.259 s under torch's
schedule, 1.064 s under this one (medians of 3 launches each).

Warm-ups per stage (plan.warmup, pipeline_warmup_list): stage p may run w_p forwards before its
first backward instead of torch's pp - p, then alternates as torch's does (B0, F(w), B1, F(w+1),
...). On unequal stages this fills the time a stage would sit idle at its first backward while
micro-batch 0 travels to a slower downstream and back; each extra forward holds one more
micro-batch's activations until its backward. Forwards still run in order 0..m-1 and backwards
in order 0..m-1, and no weight changes within a step, so every number stays bit-identical to
torch's order; only when each computation runs moves. The counts must not rise from one stage to
the next (galaxy.plan_pipeline.warmup_problems): stage p + 1 would wait for a forward stage p
holds back until it gets a gradient from p + 1. Measured on edge4 placed laptop, phone, board,
board ([3, 1, 1, 1] x 12, bench/pp_engines.py --warmup): 1.188 s a step with torch's warm-ups,
1.051 s with [10, 6, 3, 1] (medians of 3 launches).

Only gloo: under NCCL a rank's sends and receives to one peer queue on one stream, so a receive
posted early would hold the gradient send queued behind it, while the peer waits for that
gradient before it sends what the receive expects. CUDA pipelines keep torch's schedules.
"""
from __future__ import annotations

import torch.distributed as dist
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from galaxy.distributed.waiting import wait

FORWARD, BACKWARD = "F", "B"


def gpipe_order(microbatches: int, stages: int, index: int) -> list[tuple[str, int]]:
    """Fill-drain: every forward, then every backward, in micro-batch order."""
    return [(FORWARD, i) for i in range(microbatches)] + [(BACKWARD, i) for i in range(microbatches)]


def one_f_one_b_order(microbatches: int, stages: int, index: int,
                      warmup: int | None = None) -> list[tuple[str, int]]:
    """Torch's Schedule1F1B order for stage `index` of `stages`: `warmup` forwards (None: stages -
    index, torch's), then one backward and one forward until the forwards run out, then the
    remaining backwards."""
    warmup = min(microbatches, stages - index if warmup is None else warmup)
    order = [(FORWARD, i) for i in range(warmup)]
    for b in range(microbatches):
        order.append((BACKWARD, b))
        if warmup + b < microbatches:
            order.append((FORWARD, warmup + b))
    return order


def _start(ops: list[dist.P2POp]) -> list[dist.Work]:
    return dist.batch_isend_irecv(ops) if ops else []


def _finish(works: list[dist.Work]) -> None:
    for work in works:
        wait(work, pollable=False)


class OverlappedSchedule(PipelineScheduleSingle):
    """Runs `order` (a class's (kind, micro-batch) list) with receives posted at the step's start
    and sends waited for at its end (module docstring)."""

    order = staticmethod(one_f_one_b_order)

    def _step_microbatches(self, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None,
                           return_outputs=True, loss_kwargs=None):
        arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
        self._initialize_stage(arg_mbs[0], kwarg_mbs[0], target_mbs[0] if target_mbs is not None else None,
                               loss_kwargs)
        stage, m = self._stage, self._n_microbatches
        fwd_recvs, bwd_recvs = self._post_receives()
        sends: list[dist.Work] = []
        for kind, i in self._order():
            if kind == FORWARD:
                _finish(fwd_recvs[i])
                output = stage.forward_one_chunk(i, arg_mbs[i], kwarg_mbs[i], save_forward_output=return_outputs)
                sends += _start(stage.get_fwd_send_ops(i))
                self._maybe_compute_loss(stage, output, target_mbs, i, loss_kwargs)
            else:
                _finish(bwd_recvs[i])
                stage.backward_one_chunk(i, loss=self._maybe_get_loss(stage, i), last_backward=i == m - 1)
                sends += _start(stage.get_bwd_send_ops(i))
        _finish(sends)
        self._update_losses(stage, losses)
        stage.perform_reduce_grad(m if self.scale_grads else 1)

    def _order(self) -> list[tuple[str, int]]:
        return self.order(self._n_microbatches, self._num_stages, self._stage.stage_index)

    def _post_receives(self) -> tuple[list, list]:
        """Every receive of the step, started: (activations, gradients), one list of works per
        micro-batch (a stage without a backward has no gradient receives)."""
        stage, m = self._stage, self._n_microbatches
        return ([_start(stage.get_fwd_recv_ops(i)) for i in range(m)],
                [_start(stage.get_bwd_recv_ops(i)) for i in range(m)])


class OverlappedGPipe(OverlappedSchedule):
    order = staticmethod(gpipe_order)


class Overlapped1F1B(OverlappedSchedule):
    order = staticmethod(one_f_one_b_order)

    def __init__(self, stage, n_microbatches: int, *, warmups: tuple[int, ...] | None = None, **kwargs):
        """warmups: every stage's forwards before its first backward, in stage order (plan.warmup,
        checked by the plan); None: pp - p, torch's."""
        if n_microbatches < stage.num_stages:
            raise ValueError(f"1f1b needs num_microbatches ({n_microbatches}) >= the number of stages "
                             f"({stage.num_stages})")
        if warmups is not None and (len(warmups) != stage.num_stages or list(warmups) != sorted(warmups)[::-1]):
            raise ValueError(f"1f1b warm-ups {list(warmups)} must give one count per stage ({stage.num_stages}), "
                             f"never rising from one stage to the next")
        super().__init__(stage, n_microbatches, **kwargs)
        self.warmup = None if warmups is None else warmups[stage.stage_index]

    def _order(self) -> list[tuple[str, int]]:
        return self.order(self._n_microbatches, self._num_stages, self._stage.stage_index, self.warmup)
