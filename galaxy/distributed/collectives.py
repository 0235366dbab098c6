"""Raw collectives along the sequence dimension with uneven shares.

Activations are [batch, seq, hidden]; sequence shards are contiguous token ranges whose sizes
come from `sizes` (one entry per rank). gloo's all-gather needs equal sizes, so shards are padded
to the largest share and trimmed afterwards; the tensor forms (all-gather and
reduce-scatter into one tensor) are used because both gloo and NCCL implement them.
Every helper returns its input unchanged for a group of one. Each collective also has a `start_`
form that returns a Pending (async_op): the caller computes while it travels and calls wait()
(galaxy.distributed.overlap); the plain form is start(...).wait().
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from galaxy.distributed import waiting

SEQ_DIM = 1

# torch 2.13 renamed the tensor forms; older releases only have the old names.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# Communication accounting (galaxy.profiler.comm.CommRecorder): when set, called as
# comm_recorder(kind, tensor moved per rank, group size) by every collective; None costs nothing.
comm_recorder = None


class Pending:
    """A started collective: wait() returns its result once it is done (galaxy.distributed.waiting
    says whether the wait blocks or polls; pollable=False for works that only complete in wait())."""

    def __init__(self, work, finish, pollable: bool = True):
        self._work, self._finish, self._pollable = work, finish, pollable

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            waiting.wait(self._work, self._pollable)
            self._work = None
        return self._finish()


def _done(x: torch.Tensor) -> Pending:
    return Pending(None, lambda: x)


def all_reduce(x: torch.Tensor, pg) -> torch.Tensor:
    return start_all_reduce(x, pg).wait()


def start_all_reduce(x: torch.Tensor, pg) -> Pending:
    """Sum x over the group in place (x is made contiguous first); async."""
    if pg is None:
        return _done(x)
    x = x.contiguous()
    if comm_recorder is not None:
        comm_recorder("all_reduce", x, dist.get_world_size(pg))
    return Pending(dist.all_reduce(x, group=pg, async_op=True), lambda: x)


def split_sequence(x: torch.Tensor, sizes, rank: int) -> torch.Tensor:
    """Keep this rank's token range of a replicated [b, s, h] tensor."""
    if len(sizes) == 1:
        return x
    start = sum(sizes[:rank])
    return x.narrow(SEQ_DIM, start, sizes[rank]).contiguous()


def all_gather_sequence(x: torch.Tensor, sizes, pg) -> torch.Tensor:
    """[b, s_rank, ...] shards -> [b, sum(sizes), ...] on every rank."""
    return start_all_gather_sequence(x, sizes, pg).wait()


def start_all_gather_sequence(x: torch.Tensor, sizes, pg) -> Pending:
    """all_gather_sequence, started: one padded all-gather; the trim happens at wait()."""
    if pg is None:
        return _done(x)
    n, longest = len(sizes), max(sizes)
    pad = longest - x.shape[SEQ_DIM]
    x = x.movedim(SEQ_DIM, 0)                         # [s_rank, b, ...]: gathers stack on dim 0
    if pad:
        x = F.pad(x, (0,) * (2 * (x.dim() - 1)) + (0, pad))
    x = x.contiguous()
    out = x.new_empty((n * longest, *x.shape[1:]))
    if comm_recorder is not None:
        comm_recorder("all_gather", x, n)
    work = _all_gather_tensor(out, x, group=pg, async_op=True)

    def finish():
        full = out
        if any(s != longest for s in sizes):
            full = torch.cat([out[i * longest: i * longest + s] for i, s in enumerate(sizes)])
        return full.movedim(0, SEQ_DIM).contiguous()
    return Pending(work, finish)


def reduce_scatter_sequence(x: torch.Tensor, sizes, rank: int, pg) -> torch.Tensor:
    """Sum full-shape [b, S, ...] tensors over ranks and keep this rank's token range."""
    return start_reduce_scatter_sequence(x, sizes, rank, pg).wait()


def start_reduce_scatter_sequence(x: torch.Tensor, sizes, rank: int, pg) -> Pending:
    """reduce_scatter_sequence, started: one padded reduce-scatter; the trim happens at wait()."""
    if pg is None:
        return _done(x)
    longest = max(sizes)
    x = x.movedim(SEQ_DIM, 0)                         # [S, b, ...]
    if any(s != longest for s in sizes):
        chunks = torch.split(x, list(sizes))
        x = torch.cat([F.pad(c, (0,) * (2 * (x.dim() - 1)) + (0, longest - c.shape[0])) for c in chunks])
    x = x.contiguous()
    out = x.new_empty((longest, *x.shape[1:]))
    if comm_recorder is not None:
        comm_recorder("reduce_scatter", out, len(sizes))
    summed = _start_reduce_scatter(out, x, pg)
    return Pending(summed.work, lambda: summed.finish()[: sizes[rank]].movedim(0, SEQ_DIM).contiguous(),
                   summed.pollable)


class _Summed:
    def __init__(self, work, finish, pollable):
        self.work, self.finish, self.pollable = work, finish, pollable


def _start_reduce_scatter(out: torch.Tensor, x: torch.Tensor, pg) -> _Summed:
    """out = this rank's block of the sum over ranks of x (x: [n * m, ...] in rank blocks, out: [m, ...]).

    On gloo, as an all-to-all of the blocks and a local sum: every rank sends the other n - 1 ranks
    their blocks, (n - 1) / n of x, the bytes of a ring reduce-scatter, and gloo's all-to-all is
    much faster than its reduce-scatter (1.5 MB between two ranks on loopback: 0.8 ms against
    2.7 ms), and reports completion to a polling wait, which gloo's reduce-scatter never does.
    The blocks are summed in rank order, the same order on every run."""
    if dist.get_backend(pg) == "gloo":
        recv = torch.empty_like(x)
        work = dist.all_to_all_single(recv, x, group=pg, async_op=True)
        return _Summed(work, lambda: torch.sum(recv.view(-1, *out.shape), 0, out=out), True)
    work = _reduce_scatter_tensor(out, x, group=pg, async_op=True)
    return _Summed(work, lambda: out, False)


def all_gather_dim(x: torch.Tensor, sizes, dim: int, pg) -> torch.Tensor:
    """Concatenate per-rank shards of any tensor along `dim` (uneven sizes allowed).

    Used off the hot path: gathering sharded parameters and gradients for export and tests.
    """
    if pg is None:
        return x
    moved = x.movedim(dim, SEQ_DIM) if x.dim() > 1 else x.unsqueeze(0)
    gathered = all_gather_sequence(moved, sizes, pg)
    return gathered.movedim(SEQ_DIM, dim) if x.dim() > 1 else gathered.squeeze(0)
