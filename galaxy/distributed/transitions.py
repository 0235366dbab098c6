"""Layout transitions between sub-blocks, as autograd functions.

Layouts of a [batch, seq, hidden] activation inside a Galaxy group:
  R  replicated: every rank holds the full tensor, same values
  S  sequence-sharded: rank i holds tokens [offset_i, offset_i + seq[i])
  P  partial: full shape on every rank, the true value is the sum over ranks

Each transition is a forward collective paired with the backward collective that makes the
gradient right for the consumer (see docs/design.md section 2):

  P -> R                      all-reduce      | identity
  P -> S                      reduce-scatter  | all-gather
  S -> R, replicated consumer all-gather      | keep own shard
  S -> R, TP consumer         all-gather      | reduce-scatter
  R -> R, TP consumer         identity        | all-reduce
  R -> S                      split           | all-gather
"""
from __future__ import annotations

import torch
from torch import nn

from galaxy.distributed.collectives import (all_gather_sequence, all_reduce, reduce_scatter_sequence,
                                            split_sequence, sum_by_all_to_all, sum_by_exchange)
from galaxy.distributed.group import GalaxyGroup
from galaxy.distributed.overlap import (Link, chunk_sizes, copy_link, gather_link, gather_replicated_link,
                                        reduce_link, scatter_link, split_link, start, wait)
from galaxy.plan import Layout   # noqa: F401 (the layouts' home; importers take it from here too)


class _ReduceToReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.clone(), group.pg)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ReduceScatterToShards(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_sequence(x, group.tokens, group.rank, group.pg)

    @staticmethod
    def backward(ctx, grad):
        g = ctx.group
        return all_gather_sequence(grad, g.tokens, g.pg), None


class _GatherForReplicatedConsumer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_sequence(x, group.tokens, group.pg)

    @staticmethod
    def backward(ctx, grad):
        # The consumer did the same work on every rank, so every rank holds the full gradient.
        g = ctx.group
        return split_sequence(grad, g.tokens, g.rank), None


class _GatherForShardedConsumer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_sequence(x, group.tokens, group.pg)

    @staticmethod
    def backward(ctx, grad):
        # Each rank's consumer saw only its share of the work: its gradient is partial.
        g = ctx.group
        return reduce_scatter_sequence(grad, g.tokens, g.rank, g.pg), None


class _CopyForShardedConsumer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.clone(), ctx.group.pg), None


class _SplitToShards(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_sequence(x, group.tokens, group.rank)

    @staticmethod
    def backward(ctx, grad):
        g = ctx.group
        return all_gather_sequence(grad.contiguous(), g.tokens, g.pg), None


def reduce_to_replicated(x, group):           # P -> R
    return x if group.size == 1 else _ReduceToReplicated.apply(x, group)


def reduce_scatter_to_shards(x, group):       # P -> S
    return x if group.size == 1 else _ReduceScatterToShards.apply(x, group)


def gather_for_replicated_consumer(x, group):  # S -> R, consumer repeats the work
    return x if group.size == 1 else _GatherForReplicatedConsumer.apply(x, group)


def gather_for_sharded_consumer(x, group):    # S -> R, consumer is TP (or gathers K/V)
    return x if group.size == 1 else _GatherForShardedConsumer.apply(x, group)


def copy_for_sharded_consumer(x, group):      # R -> R, consumer is TP
    return x if group.size == 1 else _CopyForShardedConsumer.apply(x, group)


def split_to_shards(x, group):                # R -> S
    return x if group.size == 1 else _SplitToShards.apply(x, group)


# -- a decoded token's P -> R: generation only (no_grad), so plain functions, no backward ---------
# Which primitive sums a one-token partial output ([b, 1, h], a few KB) is a matter of rounds of
# messages, not of bytes (galaxy.parallel.decode_layout; bench/decode_ops.py measures them).

def sum_token_by_all_reduce(x, group):
    """all-reduce, in place: x is the sub-block's fresh partial output, read by nothing else."""
    return all_reduce(x, group.pg)


def sum_token_by_all_to_all(x, group):
    return sum_by_all_to_all(x, group.pg)


def sum_token_by_exchange(x, group):
    return sum_by_exchange(x, group.pg)


TOKEN_SUMS = {"all_reduce": sum_token_by_all_reduce, "all_to_all": sum_token_by_all_to_all,
              "exchange": sum_token_by_exchange}


class KVGather:
    """SP attention's K/V all-gather (S -> R for a sharded consumer): call it, or `start` it and
    call what start returns once the result is needed (the Q projection and the attention to the
    rank's own keys run in between, in forward and, mirrored, in backward:
    galaxy.distributed.overlap, galaxy.layers.attention.attention_while_gathering)."""

    def __init__(self, group: GalaxyGroup):
        self.group = group

    def __call__(self, x):
        return gather_for_sharded_consumer(x, self.group)

    def start(self, x):
        g = self.group
        link = gather_link(g.tokens, g.rank, g.pg)
        token = start(x, link)
        return lambda: wait(token, link)

    def own(self, tokens: int) -> slice:
        """Where this rank's `tokens` lie in the gathered sequence."""
        return slice(self.group.token_offset, self.group.token_offset + tokens)


def pick_transition(src: Layout, dst: Layout, sharded_consumer: bool):
    """The function that moves a `src` activation to a consumer that wants `dst`."""
    if src == Layout.P:
        if dst == Layout.R:
            return reduce_to_replicated
        if dst == Layout.S:
            return reduce_scatter_to_shards
    elif src == Layout.S:
        if dst == Layout.S:
            return None
        if dst == Layout.R:
            return gather_for_sharded_consumer if sharded_consumer else gather_for_replicated_consumer
    elif src == Layout.R:
        if dst == Layout.S:
            return split_to_shards
        if dst == Layout.R:
            return copy_for_sharded_consumer if sharded_consumer else None
    raise ValueError(f"no transition from layout {src.value} to {dst.value}")


class Transition(nn.Module):
    """A sub-block boundary. Identity until a plan gives it a layout change."""

    def __init__(self):
        super().__init__()
        self.fn = None
        self.group: GalaxyGroup | None = None
        self.label = "identity"

    def set(self, src: Layout, dst: Layout, sharded_consumer: bool, group: GalaxyGroup) -> None:
        self.fn = pick_transition(src, dst, sharded_consumer) if group.size > 1 else None
        self.group = group
        self.label = f"{src.value}->{dst.value}" + (" (TP consumer)" if sharded_consumer else "")
        if self.fn is None:
            self.label += ", identity"

    def use(self, fn, label: str, group: GalaxyGroup) -> None:
        """Run `fn(x, group)` (None: the identity) in place of the plan's transition, until set again
        (the decode phase's layouts, galaxy.parallel.decode_layout)."""
        self.fn = fn if group.size > 1 else None
        self.group = group
        self.label = label if self.fn is not None else f"{label}, identity"

    def forward(self, x):
        return x if self.fn is None else self.fn(x, self.group)

    def link(self) -> Link | None:
        """This transition as one asynchronous Link over the whole activation (the batch streams
        of galaxy.distributed.streams start it, let another stream compute, then wait); None for
        the identity."""
        g, fn = self.group, self.fn
        if fn is None:
            return None
        if fn in (copy_for_sharded_consumer, reduce_to_replicated):
            return (copy_link if fn is copy_for_sharded_consumer else reduce_link)(g.pg)
        make = {gather_for_sharded_consumer: gather_link, gather_for_replicated_consumer: gather_replicated_link,
                reduce_scatter_to_shards: scatter_link, split_to_shards: split_link}[fn]
        return make(tuple(g.tokens), g.rank, g.pg)

    def chunk_links(self, chunks: int, seq_len: int) -> list[Link] | None:
        """This transition as one asynchronous Link per chunk along the sequence
        (galaxy.distributed.overlap), or None when it is not one a token-wise sub-block can be
        chunked across: S -> R or R -> R into a TP consumer, P -> S or P -> R out of one.
        seq_len: the tokens this rank holds (its share under S, all of them under R); chunks:
        at most as many as the shortest share holds (every chunk has tokens on every rank)."""
        g, fn = self.group, self.fn
        if fn in (gather_for_sharded_consumer, reduce_scatter_to_shards):
            chunks = min(chunks, min(g.tokens))
            parts = [chunk_sizes(s, chunks) for s in g.tokens]                 # [rank][chunk]
            make = gather_link if fn is gather_for_sharded_consumer else scatter_link
            return [make(tuple(p[j] for p in parts), g.rank, g.pg) for j in range(chunks)]
        if fn in (copy_for_sharded_consumer, reduce_to_replicated):
            make = copy_link if fn is copy_for_sharded_consumer else reduce_link
            chunks = min(chunks, seq_len)
            return [make(g.pg) for _ in range(chunks)]
        return None

    def extra_repr(self) -> str:
        return self.label
