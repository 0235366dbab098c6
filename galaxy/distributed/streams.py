"""Batch streams: a micro-batch cut along its rows into independent streams that take turns.

Each stream runs every layer as a sequence of steps (a generator): a step ends right after a
sub-block boundary's collective has started (galaxy.layers.block.TransformerBlock.steps), and
`round_robin` then runs the next stream's step, so one stream's collective travels while another
stream's sub-block computes (DeepSpeed Domino's idea); from 3 streams on, every other stream
runs a step out of phase (stream_delays), so every collective travels behind some stream's ATT or
MLP. Rows are independent samples, so the result is the whole batch's up to summation order. In
backward the autograd engine runs ready nodes in reverse creation order, so the interleaved
forward graph gives an interleaved backward:
a gradient's collective (started in a Wait node's backward) travels while the other stream's
sub-block runs its backward (tests/test_batch_streams.py records the order).

Every per-batch tensor the layers read is cut the same way: the carry's [b, s, h] tensors and,
in the layer context, every tensor whose first dimension is the b rows (masks [b, 1, S, S],
rotary tables [b, S, d]); a first dimension of 1 broadcasts over rows and is kept whole.
"""
from __future__ import annotations

import torch


def run_to_end(steps):
    """Run a generator of steps to its end without interleaving; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def round_robin(streams: list, delays: list[int] | None = None) -> list:
    """Advance each generator one step in turn until all are done; their return values, in order.
    delays: rounds each stream sits out at the start (stream_delays), so streams run out of phase."""
    delays = delays or [0] * len(streams)
    results, live, turn = [None] * len(streams), list(range(len(streams))), 0
    while live:
        for i in [i for i in live if delays[i] <= turn]:
            try:
                next(streams[i])
            except StopIteration as done:
                results[i] = done.value
                live.remove(i)
        turn += 1
    return results


def stream_delays(streams: int) -> list[int]:
    """Rounds each stream sits out at the start: from 3 streams on, every other one starts a step
    late. A layer's steps alternate big (ATT, MLP: each ends by starting its output's collective)
    and small (a CON, which starts the next sub-block's input collective), so in phase every
    stream would start its small step's collective while the others run small steps too, and
    that collective would travel behind CONs only. Out of phase, what runs between a stream's
    step and its next (the other streams' turns) holds a big sub-block of a stream of the other
    phase whatever the step was. Two streams get nothing from it (each gap holds the other
    stream's one step, big or small in turn either way) and stay in phase."""
    return [i % 2 for i in range(streams)] if streams >= 3 else [0] * streams


def stream_rows(rows: int, streams: int) -> list[int]:
    """Rows per stream: `streams` near-equal parts, larger first; fewer streams when the batch
    is shorter (a short last batch), never an empty one."""
    streams = max(1, min(streams, rows))
    return [rows // streams + (1 if i < rows % streams else 0) for i in range(streams)]


def cut_rows(values: tuple, sizes: list[int]) -> list[tuple]:
    """A tuple of [b, ...] tensors (or None) -> one tuple per stream, each tensor's rows cut."""
    cut = [(None,) * len(sizes) if v is None else v.split(sizes, dim=0) for v in values]
    return [tuple(parts) for parts in zip(*cut)] if values else [() for _ in sizes]


def join_rows(parts: list[tuple]) -> tuple:
    """cut_rows' inverse: the streams' tuples joined along the rows."""
    return tuple(None if ts[0] is None else torch.cat(ts, dim=0) for ts in zip(*parts))


def cut_context(context, rows: int, sizes: list[int]) -> list:
    """A layer context (a dict, nested dicts allowed) -> one per stream: tensors whose first
    dimension is the `rows` rows are cut, everything else (broadcast tensors, flags) shared."""
    if isinstance(context, dict):
        per_key = {k: cut_context(v, rows, sizes) for k, v in context.items()}
        return [{k: v[i] for k, v in per_key.items()} for i in range(len(sizes))]
    if isinstance(context, torch.Tensor) and context.dim() > 0 and context.shape[0] == rows:
        return list(context.split(sizes, dim=0))
    return [context] * len(sizes)
