"""Pool runners for tests/test_pipeline_overlap.py: Galaxy's overlapped pipeline engine against
torch's schedules on a tiny stack of blocks, one stage per rank of the pool's world group.

Each stage's carry is two tensors [b, 4, 8]: `h`, which trains, and `side`, computed without
autograd (a frozen backbone's stream under side-tuning: it travels forward, no gradient comes back).
"""
from __future__ import annotations

import copy
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from galaxy.pipeline.overlap_schedule import Overlapped1F1B
from galaxy.pipeline.schedule import OVERLAPPED, TORCH

ROWS, SEQ, WIDTH = 2, 4, 8      # one micro-batch's carry tensors: [ROWS, SEQ, WIDTH]


class Block(nn.Module):
    """carry (h, side) -> (tanh(W h + side), side + tanh(V side)); V never trains."""

    def __init__(self, trains: bool = True):
        super().__init__()
        self.w, self.v = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.v.requires_grad_(False)
        self.w.requires_grad_(trains)
        self.calls = 0
        self.signal = None      # a path written when the second forward of a step starts

    def forward(self, h, side):
        self.calls += 1
        if self.calls == 2 and self.signal:
            open(self.signal, "w").close()
        with torch.no_grad():
            side_out = side + torch.tanh(self.v(side))
        return torch.tanh(self.w(h) + side), side_out


def carry_meta(rows: int, trains: bool) -> tuple:
    return (torch.empty(rows, SEQ, WIDTH, device="meta", requires_grad=trains),
            torch.empty(rows, SEQ, WIDTH, device="meta"))


def loss_fn(carry, target):
    h, side = carry
    return ((h + side).sum(-1) - target).pow(2).mean()


def _stage(block, frozen_first: bool):
    pp, rank = dist.get_world_size(), dist.get_rank()
    received = carry_meta(ROWS, not (frozen_first and rank == 1))
    sent = carry_meta(ROWS, not (frozen_first and rank == 0))
    return PipelineStage(block, rank, pp, torch.device("cpu"), input_args=received, output_args=sent)


def run_steps(schedule_cls, microbatches: int, frozen_first: bool, steps: int = 2, **schedule_kwargs) -> dict:
    """`steps` SGD steps of the tiny pipeline under schedule_cls (schedule_kwargs: its own, e.g.
    warmups): this stage's losses per step, the gradients after each step, the final weights and
    the stage's computations in the order they ran (("F" | "B", micro-batch), every step's)."""
    torch.manual_seed(0)
    pp, rank = dist.get_world_size(), dist.get_rank()
    blocks = [Block(trains=not (frozen_first and i == 0)) for i in range(pp)]     # equal on every rank
    block = copy.deepcopy(blocks[rank])
    trains = any(p.requires_grad for p in block.parameters())
    stage = _stage(block, frozen_first)
    schedule = schedule_cls(stage, microbatches, loss_fn=loss_fn if trains or rank == pp - 1 else None,
                            scale_grads=False, **schedule_kwargs)
    out = {"losses": [], "grads": [], "ran": _record_computations(stage)}
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(ROWS * microbatches, SEQ, WIDTH, generator=g)
        target = torch.randn(ROWS * microbatches, SEQ, generator=g)
        losses = [] if rank == pp - 1 else None
        args = (x, torch.cos(x)) if rank == 0 else ()
        schedule.step(*args, target=target if rank == pp - 1 else None, losses=losses, return_outputs=False)
        out["losses"].append([t.detach().clone() for t in losses or []])
        out["grads"].append([None if p.grad is None else p.grad.clone() for p in block.parameters()])
        with torch.no_grad():
            for p in block.parameters():
                if p.grad is not None:
                    p -= 0.1 * p.grad
                    p.grad = None
    out["weights"] = [p.detach().clone() for p in block.parameters()]
    return out


def _record_computations(stage) -> list:
    """A list that the stage's forward_one_chunk and backward_one_chunk append their (kind,
    micro-batch) to, as they start."""
    ran = []
    for kind, name in (("F", "forward_one_chunk"), ("B", "backward_one_chunk")):
        def logged(i, *args, _run=getattr(stage, name), _kind=kind, **kwargs):
            ran.append((_kind, i))
            return _run(i, *args, **kwargs)
        setattr(stage, name, logged)
    return ran


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def engines_agree(schedule: str, microbatches: int, frozen_first: bool = False) -> dict:
    """Whether Galaxy's engine gives bit-identical losses, gradients and weights to torch's
    schedule of the same name; with what each computed (for the test's own checks)."""
    ours = run_steps(OVERLAPPED[schedule], microbatches, frozen_first)
    torch_ = run_steps(TORCH[schedule], microbatches, frozen_first)
    return {"equal": _same(ours, torch_), "losses": len(ours["losses"][-1]),
            "grads": [g is not None for g in ours["grads"][-1]],
            "moved": not _same(ours["weights"], run_steps(TORCH[schedule], microbatches, frozen_first, 0)["weights"])}


def warmups_agree(microbatches: int, warmups: list[int], frozen_first: bool = False) -> dict:
    """Whether Galaxy's 1f1b with these warm-ups per stage gives bit-identical losses, gradients
    and weights to torch's Schedule1F1B (warm-ups pp - p); with the order this stage ran its last
    step in."""
    ours = run_steps(OVERLAPPED["1f1b"], microbatches, frozen_first, warmups=tuple(warmups))
    torch_ = run_steps(TORCH["1f1b"], microbatches, frozen_first)
    ran = ours.pop("ran")
    torch_.pop("ran")
    step = len(ran) // 2
    return {"equal": _same(ours, torch_), "losses": len(ours["losses"][-1]), "ran": ran[step:]}


class _LateReceives(list):
    """One micro-batch's gradient receives, posted only when the schedule waits for them, and then
    only once `signal` exists (or `patience` s have passed): a peer that receives late."""

    def __init__(self, ops, signal: str, patience: float, seen: list):
        super().__init__()
        self.ops, self.signal, self.patience, self.seen = ops, signal, patience, seen

    def __iter__(self):
        end = time.monotonic() + self.patience
        while not os.path.exists(self.signal) and time.monotonic() < end:
            time.sleep(0.005)
        self.seen.append(os.path.exists(self.signal))
        return iter(dist.batch_isend_irecv(self.ops) if self.ops else [])


class LateGradientReceiver(Overlapped1F1B):
    """Galaxy's 1f1b whose gradient receives wait for the peer's signal (_LateReceives)."""

    signal, patience, seen = "", 0.0, None

    def _post_receives(self):
        stage, m = self._stage, self._n_microbatches
        return ([dist.batch_isend_irecv(ops) if (ops := stage.get_fwd_recv_ops(i)) else [] for i in range(m)],
                [_LateReceives(stage.get_bwd_recv_ops(i), self.signal, self.patience, self.seen) for i in range(m)])


def computes_before_its_send_is_received(engine: str, signal_dir: str, patience: float) -> bool | None:
    """Two stages, 3 micro-batches of 1f1b. Stage 0 posts its receive of micro-batch 0's gradient
    only once stage 1 has started its forward of micro-batch 1 (or after `patience` s). Stage 1
    (the last: F0 B0 F1 B1 F2 B2) runs `engine`'s schedule; it sends that gradient after B0 and
    computes F1 next. On stage 0: whether F1 started before the gradient's receive was posted."""
    torch.manual_seed(0)
    rank, signal = dist.get_rank(), os.path.join(signal_dir, "f1")
    block = Block()
    stage = _stage(block, False)
    if rank == 0:
        schedule = LateGradientReceiver(stage, 3, loss_fn=loss_fn, scale_grads=False)
        schedule.signal, schedule.patience, schedule.seen = signal, patience, []
        x = torch.randn(ROWS * 3, SEQ, WIDTH)
        schedule.step(x, torch.cos(x), return_outputs=False)
        return schedule.seen[0]
    block.signal = signal
    cls = (OVERLAPPED if engine == "galaxy" else TORCH)["1f1b"]
    cls(stage, 3, loss_fn=loss_fn, scale_grads=False).step(target=torch.zeros(ROWS * 3, SEQ), losses=[],
                                                            return_outputs=False)
    return None
