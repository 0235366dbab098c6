"""Collectives that travel while compute goes on, in forward and in backward.

A transition's collective is split into two autograd nodes joined by a zero-size token:

    start(x) -> token        forward: start the collective      backward: wait for the gradient's
    wait(token) -> y         forward: wait, return the result   backward: start the gradient's

Whatever is computed between start and wait overlaps the forward collective; in backward the
autograd engine runs nodes in reverse creation order, so the same work runs between the
gradient's start (in wait's backward) and its wait (in start's backward). Every rank builds the
same graph, so every rank issues the same collectives in the same order.

`chunked_tokenwise` uses this for a sub-block that works token by token (the MLP): the sequence
is cut into chunks, every chunk's input all-gather starts up front, then chunk i's GEMMs run while
chunk i+1's gather travels and chunk i-1's output reduce-scatter does (tile-based overlap), and
the reverse in backward. Chunk j of the gathered sequence is every rank's own chunk j, so the
token order inside a chunk differs from the full sequence's; a token-wise sub-block does not care
and the reduce-scatter hands each rank back its own tokens.

`chunked_attention` does the same for a TP ATT, whose projections are token-wise and whose
attention core is not: Q/K/V are projected chunk by chunk as the input chunks arrive, put back in
sequence order for the core (one index_select each), and the context is projected out chunk by
chunk as the output collectives leave.

Both also come as steps (`*_steps`, generators: galaxy.distributed.streams) that yield once the
input chunks travel and once the output chunks do, so batch streams can interleave them; the
plain functions run the steps to the end. `Transition.link` (galaxy.distributed.transitions)
makes one Link of every transition kind for a whole activation.
"""
from __future__ import annotations

import functools

import torch

from galaxy.distributed.collectives import (Pending, split_sequence, start_all_gather_sequence, start_all_reduce,
                                            start_reduce_scatter_sequence)
from galaxy.distributed.streams import run_to_end


class Link:
    """One collective and the one its gradient needs: (forward start, backward start), each
    tensor -> Pending; holds the pending ones between the two nodes. sizes: tokens per rank of a
    sequence all-gather or reduce-scatter (None for the all-reduce links, which keep the sequence)."""

    def __init__(self, forward, backward, sizes=None):
        self.forward, self.backward, self.sizes = forward, backward, sizes
        self.fwd: Pending | None = None
        self.bwd: Pending | None = None


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, link):
        ctx.link = link
        link.fwd = link.forward(x)
        return x.new_empty(0)

    @staticmethod
    def backward(ctx, _):
        pending, ctx.link.bwd = ctx.link.bwd, None
        return pending.wait(), None


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, token, link):
        ctx.link = link
        pending, link.fwd = link.fwd, None
        return pending.wait()

    @staticmethod
    def backward(ctx, grad):
        ctx.link.bwd = ctx.link.backward(grad)
        return grad.new_empty(0), None


def start(x: torch.Tensor, link: Link) -> torch.Tensor:
    return _Start.apply(x, link)


def wait(token: torch.Tensor, link: Link) -> torch.Tensor:
    return _Wait.apply(token, link)


# --- the links of the layout transitions (galaxy.distributed.transitions) ---------------------

def gather_link(sizes, rank: int, pg) -> Link:
    """S -> R for a TP consumer: all-gather | reduce-scatter of the gradient (rank's own share)."""
    return Link(lambda x: start_all_gather_sequence(x, sizes, pg),
                lambda g: start_reduce_scatter_sequence(g, sizes, rank, pg), sizes)


def scatter_link(sizes, rank: int, pg) -> Link:
    """P -> S: reduce-scatter | all-gather of the gradient."""
    return Link(lambda x: start_reduce_scatter_sequence(x, sizes, rank, pg),
                lambda g: start_all_gather_sequence(g, sizes, pg), sizes)


def gather_replicated_link(sizes, rank: int, pg) -> Link:
    """S -> R for a consumer that repeats the work on every rank: all-gather | keep own share."""
    return Link(lambda x: start_all_gather_sequence(x, sizes, pg),
                lambda g: Pending(None, lambda: split_sequence(g, sizes, rank)), sizes)


def split_link(sizes, rank: int, pg) -> Link:
    """R -> S: keep own share | all-gather of the gradient."""
    return Link(lambda x: Pending(None, lambda: split_sequence(x, sizes, rank)),
                lambda g: start_all_gather_sequence(g.contiguous(), sizes, pg), sizes)


def copy_link(pg) -> Link:
    """R -> R for a TP consumer: nothing | all-reduce of the gradient."""
    return Link(lambda x: Pending(None, lambda: x.clone()),
                lambda g: start_all_reduce(g.clone(), pg))


def reduce_link(pg) -> Link:
    """P -> R: all-reduce | nothing."""
    return Link(lambda x: start_all_reduce(x.clone(), pg),
                lambda g: Pending(None, lambda: g))


def chunk_sizes(total: int, chunks: int) -> list[int]:
    """`total` tokens in `chunks` near-equal parts (the first ones one longer)."""
    return [total // chunks + (1 if j < total % chunks else 0) for j in range(chunks)]


def chunked_tokenwise(x: torch.Tensor, fn, chunks: int, in_links, out_links):
    """fn over the sequence in chunks, each chunk's collectives overlapped with the others' GEMMs.

    x: [b, s, h], this rank's part of the input; chunk j is x's j-th part along the sequence
    (chunk_sizes(s, chunks)). in_links[j] / out_links[j]: chunk j's transition into fn and out of it.
    fn(x_j) -> (y_j, extra): y_j [b, s_j', h'], extra the same every call (a deferred bias).
    Returns (y [b, sum of the chunks' results along the sequence, h'], extra).
    """
    return run_to_end(chunked_tokenwise_steps(x, fn, chunks, in_links, out_links))


def chunked_tokenwise_steps(x: torch.Tensor, fn, chunks: int, in_links, out_links):
    """chunked_tokenwise as steps (galaxy.distributed.streams): it yields once every input chunk
    travels and once every output chunk does, so another batch stream can compute meanwhile."""
    tokens = _start_chunks(x, chunks, in_links)
    yield
    return (yield from _finish_chunks((wait(t, link) for t, link in zip(tokens, in_links)), fn, out_links))


def chunked_attention(x: torch.Tensor, att, chunks: int, in_links, out_links, **att_kwargs):
    """A TP ATT (the block protocol's project / attend / finish) with its input and output
    transitions in chunks: x [b, s, h] as in chunked_tokenwise -> (y, deferred bias).

    att.project runs on each input chunk as it arrives; the chunks' results, in gathered order,
    are put in sequence order for att.attend (the core needs every key, in order, for masks and
    rotary positions); the context goes back to gathered order and att.finish runs chunk by chunk,
    each result leaving while the next is computed.
    """
    return run_to_end(chunked_attention_steps(x, att, chunks, in_links, out_links, **att_kwargs))


def chunked_attention_steps(x: torch.Tensor, att, chunks: int, in_links, out_links, **att_kwargs):
    """chunked_attention as steps, yielding where chunked_tokenwise_steps does."""
    tokens = _start_chunks(x, chunks, in_links)
    yield
    projected = [att.project(wait(t, link)) for t, link in zip(tokens, in_links)]   # [chunk](q, k, v)
    lengths = [p[0].shape[1] for p in projected]
    orders = gathered_order(in_links, x.device)    # None: the chunks are already in sequence order
    whole = [torch.cat(parts, dim=1) for parts in zip(*projected)]                 # [b, S, *] each
    if orders is not None:
        order, back = orders
        whole = [t.index_select(1, back) for t in whole]
    ctx = att.attend(*whole, **att_kwargs)                                          # [b, S, heads*d]
    if orders is not None:
        ctx = ctx.index_select(1, order)
    return (yield from _finish_chunks(ctx.split(lengths, dim=1), att.finish, out_links))


def gathered_order(links, device=None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(order, back) for the chunked all-gathers' results laid end to end (chunk j: rank 0's j-th
    part of its share, then rank 1's, ...): order[i] is the sequence position of token i, and
    index_select(back) puts them in sequence order. None for all-reduce links (already in order)."""
    if links[0].sizes is None:
        return None
    return _orders(tuple(tuple(link.sizes) for link in links), torch.device(device or "cpu"))


@functools.lru_cache(maxsize=256)
def _orders(sizes: tuple, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # sizes[j][r]: rank r's tokens in chunk j. Built once per (shares, chunks, device), not per layer.
    per_rank = [sum(chunk[r] for chunk in sizes) for r in range(len(sizes[0]))]
    start = [sum(per_rank[:r]) for r in range(len(per_rank))]
    order = []
    for chunk in sizes:
        for r, n in enumerate(chunk):
            order.extend(range(start[r], start[r] + n))
            start[r] += n
    order = torch.tensor(order, device=device)
    return order, torch.argsort(order)


def _start_chunks(x, chunks: int, links) -> list:
    """Start every chunk's input collective; the tokens to wait on, chunk by chunk."""
    parts = x.split(chunk_sizes(x.shape[1], chunks), dim=1)
    return [start(p, link) for p, link in zip(parts, links)]


def _finish_chunks(parts, fn, out_links):
    """fn on each part in turn, its result's output collective started at once; then (after a
    step's yield) wait for them all: (results joined along the sequence, fn's extra)."""
    outs, extra = [], None
    for part, link in zip(parts, out_links):
        y, extra = fn(part)
        outs.append(start(y, link))
    yield
    return torch.cat([wait(t, link) for t, link in zip(outs, out_links)], dim=1), extra
