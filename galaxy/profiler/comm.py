"""Bytes each rank sends and receives, counted from the collectives actually issued.

galaxy.distributed.collectives calls `collectives.comm_recorder(kind, tensor, group_size)` once
per collective while a CommRecorder is installed (it is None, and free, otherwise). `tensor` is
what the collective moves per rank, padded as sent:
  all_gather      this rank's shard (padded to the largest share)
  reduce_scatter  this rank's output chunk (padded to the largest share)
  all_reduce      the whole buffer

Convention: bytes on the wire per rank in the bandwidth-optimal ring algorithm, which is what
NCCL and gloo run for large buffers. With N ranks, shard/chunk of C bytes, buffer of E elements:
  all_gather      sends (N-1)*C, receives (N-1)*C  (passes every shard but one along the ring)
  reduce_scatter  sends (N-1)*C, receives (N-1)*C
  all_reduce      a reduce-scatter plus an all-gather of chunks of ceil(E/N) elements:
                  sends 2*(N-1)*ceil(E/N)*element_size, receives the same
A split of a replicated tensor (R -> S) is local and moves nothing.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from galaxy.distributed import collectives
from galaxy.distributed.comm_bytes import ring_bytes

KINDS = ("all_gather", "reduce_scatter", "all_reduce")


@dataclass
class CommCount:
    calls: int = 0
    sent: int = 0
    received: int = 0

    def add(self, other: "CommCount") -> None:
        self.calls += other.calls
        self.sent += other.sent
        self.received += other.received


@dataclass
class CommStats:
    """Per training step of one rank: {phase: {kind: CommCount}}; phases forward, backward, grad_sync."""
    group_size: int = 1
    by_phase: dict = field(default_factory=lambda: defaultdict(lambda: defaultdict(CommCount)))

    def by_kind(self) -> dict[str, CommCount]:
        out: dict[str, CommCount] = {}
        for kinds in self.by_phase.values():
            for kind, c in kinds.items():
                out.setdefault(kind, CommCount()).add(c)
        return out

    def total(self) -> CommCount:
        out = CommCount()
        for c in self.by_kind().values():
            out.add(c)
        return out

    def to_dict(self) -> dict:
        plain = lambda c: {"calls": c.calls, "sent": c.sent, "received": c.received}  # noqa: E731
        return {"group_size": self.group_size,
                "by_kind": {k: plain(c) for k, c in sorted(self.by_kind().items())},
                "by_phase": {p: {k: plain(c) for k, c in sorted(ks.items())} for p, ks in self.by_phase.items()},
                "total": plain(self.total())}


class CommRecorder:
    """Installs itself as collectives.comm_recorder; `phase` says where the step is."""

    def __init__(self):
        self.stats = CommStats()
        self.phase = "forward"

    def __call__(self, kind: str, tensor: torch.Tensor, group_size: int) -> None:
        self.stats.group_size = max(self.stats.group_size, group_size)
        b = ring_bytes(kind, tensor.numel(), tensor.element_size(), group_size)
        c = self.stats.by_phase[self.phase][kind]
        c.calls += 1
        c.sent += b
        c.received += b

    def __enter__(self):
        if collectives.comm_recorder is not None:
            raise RuntimeError("a CommRecorder is already installed")
        collectives.comm_recorder = self
        return self

    def __exit__(self, *exc):
        collectives.comm_recorder = None
