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

from galaxy.distributed import pair_exchange, waiting

SEQ_DIM = 1

# torch 2.13 renamed the tensor forms; older releases only have the old names.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# Communication accounting (galaxy.profiler.comm.CommRecorder): when set, called as
# comm_recorder(kind, tensor moved per rank, group size) by every collective; None costs nothing.
comm_recorder = None
# On gloo, a reduce-scatter runs as an all-to-all and a local sum (_start_reduce_scatter); False
# (tests only) runs gloo's own, the path every other backend takes.
reduce_scatter_as_all_to_all = True


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


# -- a decoded token's sums: latency is all they cost --------------------------------------------

def sum_by_all_to_all(x: torch.Tensor, pg) -> torch.Tensor:
    """x summed over the group, for tensors so small that each round of messages is their cost (a
    decoded token's [b, 1, h], a few KB): one all-to-all in which every rank sends x to every other
    rank, a single round of direct messages where a ring all-reduce takes 2 (n - 1), then the n
    copies summed in rank order, the same order on every rank (every rank holds the same bits).
    Not differentiable: for generation, under no_grad. gloo's all-to-all reports completion to a
    polling wait (waiting.py)."""
    if pg is None:
        return x
    n = dist.get_world_size(pg)
    sent = x.expand(n, *x.shape).contiguous()                           # [n, *x.shape]: n copies
    got = torch.empty_like(sent)
    if comm_recorder is not None:
        comm_recorder("all_gather", x, n)          # (n - 1) copies of x sent: an all-gather's bytes
    waiting.wait(dist.all_to_all_single(got, sent, group=pg, async_op=True))
    return got.sum(0)


def sum_by_exchange(x: torch.Tensor, pg) -> torch.Tensor:
    """x summed over a group of two by one paired send and receive: x + the peer's x (addition
    commutes, so both ranks hold the same bits). Not differentiable, as sum_by_all_to_all. gloo's
    send and receive works report completion only inside wait(): waiting.wait blocks on them."""
    if pg is None:
        return x
    if dist.get_world_size(pg) != 2:
        raise ValueError("sum_by_exchange is for a group of two ranks")
    peer = dist.get_global_rank(pg, 1 - dist.get_rank(pg))
    x = x.contiguous()
    got = torch.empty_like(x)
    if comm_recorder is not None:
        comm_recorder("all_gather", x, 2)          # one copy of x sent: an all-gather's bytes
    ops = [dist.P2POp(dist.isend, x, peer, pg), dist.P2POp(dist.irecv, got, peer, pg)]
    for work in dist.batch_isend_irecv(ops):
        waiting.wait(work)
    return x + got


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
    """all_gather_sequence, started: one padded all-gather; the trim happens at wait().

    The shards are gathered as they lie ([b, s_rank, ...], padded to the longest share) into a
    [n, b, longest, ...] stack, and wait() lays the stack out along the sequence: one copy (none
    for b == 1 with even shares)."""
    if pg is None:
        return _done(x)
    n, longest = len(sizes), max(sizes)
    pad = longest - x.shape[SEQ_DIM]
    if pad:
        x = F.pad(x, _pad_seq(x, pad))
    x = x.contiguous()
    flat = x.new_empty((n * x.shape[0], *x.shape[1:]))     # the concatenation gloo's all-gather takes
    if comm_recorder is not None:
        comm_recorder("all_gather", x, n)
    if pair_exchange.applies(pg):      # two ranks on gloo: receive posted first (pair_exchange.py says why)
        work, pollable = pair_exchange.start_all_gather(flat, x, pg), False
    else:
        work, pollable = _all_gather_tensor(flat, x, group=pg, async_op=True), True

    def finish():
        out = flat.view(n, *x.shape)
        if any(s != longest for s in sizes):
            return torch.cat([out[i].narrow(SEQ_DIM, 0, s) for i, s in enumerate(sizes)], dim=SEQ_DIM)
        return out.movedim(0, SEQ_DIM).reshape(x.shape[0], n * longest, *x.shape[2:])
    return Pending(work, finish, pollable)


def _pad_seq(x: torch.Tensor, pad: int) -> tuple[int, ...]:
    """F.pad's argument that appends `pad` zero tokens to dim 1 of x."""
    return (0,) * (2 * (x.dim() - 2)) + (0, pad)


def reduce_scatter_sequence(x: torch.Tensor, sizes, rank: int, pg) -> torch.Tensor:
    """Sum full-shape [b, S, ...] tensors over ranks and keep this rank's token range."""
    return start_reduce_scatter_sequence(x, sizes, rank, pg).wait()


def start_reduce_scatter_sequence(x: torch.Tensor, sizes, rank: int, pg) -> Pending:
    """reduce_scatter_sequence, started: one padded reduce-scatter; the trim happens at wait().

    x [b, S, ...] is laid out as a [n, b, longest, ...] stack of the ranks' token ranges (padded
    to the longest: one copy, none for b == 1 with even shares); the sum of every rank's block is
    a [b, longest, ...] tensor, already in this rank's layout."""
    if pg is None:
        return _done(x)
    n, longest = len(sizes), max(sizes)
    if any(s != longest for s in sizes):
        blocks = torch.stack([F.pad(c, _pad_seq(c, longest - c.shape[SEQ_DIM]))
                              for c in torch.split(x, list(sizes), dim=SEQ_DIM)])
    else:
        blocks = x.reshape(x.shape[0], n, longest, *x.shape[2:]).movedim(1, 0).contiguous()
    out = blocks.new_empty(blocks.shape[1:])
    if comm_recorder is not None:
        comm_recorder("reduce_scatter", out, n)
    work, summed, pollable = _start_reduce_scatter(out, blocks, pg)
    if sizes[rank] == longest:
        return Pending(work, summed, pollable)
    return Pending(work, lambda: summed().narrow(SEQ_DIM, 0, sizes[rank]).contiguous(), pollable)


def _start_reduce_scatter(out: torch.Tensor, x: torch.Tensor, pg):
    """out = this rank's block of the sum over ranks of x (x: [n, ...] rank blocks, out: [...]);
    returns (the started work, a function that finishes out and returns it, whether the work
    reports completion to a polling wait).

    On gloo, as an all-to-all of the blocks and a local sum: every rank sends the other n - 1 ranks
    their blocks, (n - 1) / n of x, the bytes of a ring reduce-scatter, and gloo's all-to-all is
    much faster than its reduce-scatter (1.5 MB between two ranks on loopback: 0.8 ms against
    2.7 ms), and reports completion to a polling wait, which gloo's reduce-scatter never does.
    The blocks are summed in rank order, the same order on every run. A two-rank gloo group sends
    its one block by a paired exchange instead (galaxy.distributed.pair_exchange: gloo's all-to-all
    runs the two directions one after the other when the ranks arrive apart)."""
    if reduce_scatter_as_all_to_all and pair_exchange.applies(pg):
        work, finish = pair_exchange.start_reduce_scatter(out, x, pg)
        return work, finish, False
    if reduce_scatter_as_all_to_all and dist.get_backend(pg) == "gloo":
        recv = torch.empty_like(x)
        work = dist.all_to_all_single(recv, x, group=pg, async_op=True)
        return work, lambda: torch.sum(recv, 0, out=out), True
    concatenated = x.view(-1, *x.shape[2:])             # the primary-dimension concatenation every backend takes
    work = _reduce_scatter_tensor(out, concatenated, group=pg, async_op=True)
    return work, lambda: out, False


def all_gather_dim(x: torch.Tensor, sizes, dim: int, pg) -> torch.Tensor:
    """Concatenate per-rank shards of any tensor along `dim` (uneven sizes allowed).

    Used off the hot path: gathering sharded parameters and gradients for export and tests.
    """
    if pg is None:
        return x
    moved = x.movedim(dim, SEQ_DIM) if x.dim() > 1 else x.unsqueeze(0)
    gathered = all_gather_sequence(moved, sizes, pg)
    return gathered.movedim(SEQ_DIM, dim) if x.dim() > 1 else gathered.squeeze(0)
