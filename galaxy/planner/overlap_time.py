"""The overlapped time of one pass (forward or backward) of a Galaxy group's layers under the plan's
batch_streams and comm_chunks, and the settings of the two the search tries.

Without either, every boundary collective is exposed: a pass takes compute + comm (what the cost
model did before overlap). With n batch streams (galaxy.distributed.streams) a stream's collective
at a boundary travels while the other n - 1 streams compute; with c chunks
(galaxy.distributed.overlap) a TP sub-block's collective travels while (c - 1) / c of its own
sub-block computes. h = (n - 1) + (c - 1) / c counts those boundary-shares of compute. On the edge
testbed's one-core devices neither hides as a perfect pipeline would (max(compute', comm)): the
streams meet at the pass's first and last boundary and at every collective the other streams'
are still on the link, and one core both computes and drives the link. What the measured steps
follow is a pass of the larger of the two plus a share of the smaller left exposed, the share
falling with h:

    pass = cpu + max(compute', wire) + e * min(compute', wire),     e = 1 / (1 + HIDE_RATE * h)

where wire is the link carrying the collectives' bytes (the link fit's rate: link_model.wire_time)
and cpu = comm - wire their per-call rest, the ranks' own copies and syscalls, which a one-core
device cannot run beside its compute (at 1 Gbit/s batch 8, a full devices profile taken there: the unshaped step is 133 ms over the
compute tables' 465; hiding it as wire time predicted 2 streams at 0.83 of the measured step, as
cpu 0.92). At h = 0 the pass is compute + comm (nothing overlaps); as h grows, cpu + the larger.
compute' is the pass's compute with what streams and chunks cost on the device: half-size GEMMs,
twice the calls, and on a one-core device the in-flight collectives' copies competing with the
GEMMs. That is a measured term per extra stream and per extra chunk: `stream_cost` and
`chunk_cost` in the device profile when it has them (the slowest of the group's devices),
else the figures fitted on the edge testbed's one-core devices (bench/overlap_paired.py on an
unshaped link, the same plan's step with and without: STREAM_COST, CHUNK_COST below).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

# Fitted on two one-core devices of the edge testbed, unshaped link, all-MiniLM-L6-v2 at 8 and 4
# x 128 (bench/overlap_paired.py, the Galaxy plan's step with n streams or c chunks against 1
# stream and 1 chunk, paired medians). 2026-11-26, 4 runs beside other work: 1.04-1.17 (2
# streams), 0.98-1.24 (3), 1.06-1.37 (4); 1.11-1.30 (2 chunks), 1.23-1.36 (4). Refitted the same
# day on 6 shielded runs (3 at each batch, load 20-130 held off by --shield): 1.12-1.25 (2
# streams), 1.33-1.51 (4); 1.24-1.36 (4 chunks): least squares over both stream counts 13% per
# extra stream; chunks 8-12% per extra one, so 12% stays.
STREAM_COST = 0.13
CHUNK_COST = 0.12
# Fitted on the same testbed after its links stopped cutting TCP's segments (docs/edge.md;
# bench/results/overlap_paired.md, 2026-11-26, 300 Mbit/s batch 2, 4, 8 and 1 Gbit/s batch 4, 8:
# 1, 2 or 4 chunks, 1 to 4 streams), each variant's measured unshaped step as compute' and bytes /
# rate as comm, least squares on log(predicted / measured) over 22 medians: 5.9 (rms 8%). The
# exposed share of the smaller term: 2 streams 0.15, 3 0.08, 4 0.05; 2 chunks 0.25, 4 0.18.
HIDE_RATE = 5.9

STREAM_CHOICES = (1, 2, 3, 4)
CHUNK_CHOICES = (1, 2, 4)


@dataclass(frozen=True)
class Overlap:
    """How one pass overlaps: n streams, c chunks, and the devices' cost of each extra one."""
    streams: int = 1
    chunks: int = 1
    stream_cost: float = STREAM_COST
    chunk_cost: float = CHUNK_COST

    @property
    def hiding(self) -> float:
        """h: boundary-shares of compute a boundary's collective travels behind (module docstring)."""
        return (self.streams - 1) + (self.chunks - 1) / self.chunks

    def compute(self, seconds: float) -> float:
        """The pass's compute with the streams' and chunks' own cost."""
        return seconds * (1 + self.stream_cost * (self.streams - 1)) * (1 + self.chunk_cost * (self.chunks - 1))


def overlapped_pass(compute: float, comm: float, boundaries: float, overlap: Overlap, wire: float | None = None) -> float:
    """Seconds of a pass: `compute` seconds of sub-blocks, `comm` seconds of its `boundaries`
    boundary collectives, `wire` of them the link carrying bytes (None: all; module docstring)."""
    if overlap.streams == overlap.chunks == 1 or boundaries <= 0:
        return compute + comm
    wire = comm if wire is None else min(wire, comm)
    work = overlap.compute(compute)
    exposed_share = 1.0 / (1.0 + HIDE_RATE * overlap.hiding)
    return (comm - wire) + max(work, wire) + exposed_share * min(work, wire)


def pass_overlap(plan, rows: float, devices: list[dict], runs_streams: bool = True) -> Overlap:
    """The Overlap a plan's pass runs with: streams as many as the micro-batch's rows allow (one
    when the method runs a single stream: side-tuning), chunks where a TP sub-block chunks, the
    costs from the group's device profiles (the largest) or the fitted defaults."""
    streams = max(1, min(plan.batch_streams, int(rows))) if runs_streams else 1
    chunks = plan.comm_chunks if plan.group > 1 and "TP" in (plan.att, plan.mlp) else 1
    costs = [(d.get("stream_cost", STREAM_COST), d.get("chunk_cost", CHUNK_COST)) for d in devices]
    return Overlap(streams, chunks, max(c[0] for c in costs), max(c[1] for c in costs))


def overlap_choices(plan, rows: int) -> list:
    """The plan under every batch_streams x comm_chunks the search tries: streams up to the rows
    of the smallest micro-batch (none under FSDP2, which config refuses), chunks for a TP
    sub-block's collectives in a group of two or more, at most the shortest token share."""
    streams = [n for n in STREAM_CHOICES if n <= rows and (n == 1 or plan.dp_sharding == "none")]
    tp = plan.group > 1 and "TP" in (plan.att, plan.mlp)
    chunks = [c for c in CHUNK_CHOICES if c == 1 or (tp and c <= min(plan.tokens))]
    return [replace(plan, batch_streams=n, comm_chunks=c) for n in streams for c in chunks]
