"""The link part of `plan.py profile-devices`: collectives and sends timed on the real process
group, each call after a burst of compute as a step makes it (galaxy.planner.device_profile)."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from galaxy.distributed.collectives import all_gather_sequence, all_reduce, reduce_scatter_sequence, sum_by_all_to_all
from galaxy.distributed.token_link import TokenLink
from galaxy.parallel.decode_layout import SOCKET, default_token_sum
from galaxy.planner.decode_time import PICK_BYTES
from galaxy.planner.profiles import fit_pair

# The link profile (measure_link): batches of calls about LINK_BATCH_S long, at most MAX_CALLS,
# each call after BURST_S of GEMMs on BURST_GEMM x BURST_GEMM matrices.
LINK_BATCH_S, MAX_CALLS, BURST_S, BURST_GEMM = 0.06, 32, 0.003, 128

def measure_link(env, sizes: list[int], repeats: int) -> list[dict]:
    """Timed collectives on the world group: [{"kind", "group", "bytes", "uneven", "seconds"}]
    (bytes: what one rank sends, ring convention; seconds: the slowest rank's mean per call).

    Every call is timed as a step makes it: after BURST_S of GEMMs on every rank, the work a
    sub-block does before its collective. Back-to-back calls meet warm buffers, a busy gloo thread
    and ranks in lockstep; a call after compute meets what a sub-block leaves behind (the peer a
    little early or late, the communication thread asleep), and took 1.3-2.6x as long on this
    project's 2-core VM at the sizes a step moves (bench/results/plan_accuracy.md). The mean of
    every call is kept whatever --statistic says: a step pays every call, its slow ones too (a
    waiting thread woken a scheduler tick late: 4 ms on some VMs, against 0.3 ms typical)."""
    timer = _LinkTimer(env, repeats)
    for size in sizes:
        timer.gathers(size)
        timer.all_reduce(size)
        timer.send_recv(size)
    return timer.out


class _LinkTimer:
    """The collectives of measure_link, each timed after a burst of GEMMs, recorded at the slowest rank."""

    WIDTH = 64          # features per token of the gathered and scattered activations

    def __init__(self, env, repeats: int):
        self.n, self.rank, self.device, self.repeats = env.world, env.rank, env.device, repeats
        self.pg = dist.group.WORLD
        self.sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        self.square = torch.randn(BURST_GEMM, BURST_GEMM, device=self.device)
        self.out: list[dict] = []

    def burst(self) -> None:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < BURST_S:
            self.square @ self.square
            self.sync()

    def timed(self, fn) -> float:
        """Mean seconds per call, each call after a burst, over `repeats` batches of calls; a batch
        is about LINK_BATCH_S long (at least one call, at most MAX_CALLS), judged by one call."""
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        once = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=self.device)
        dist.all_reduce(once, op=dist.ReduceOp.MAX)           # every rank must make as many calls
        calls = self.repeats * max(1, min(MAX_CALLS, int(LINK_BATCH_S / (BURST_S + max(once.item(), 1e-6)))))
        spent = 0.0
        for _ in range(calls):
            self.burst()
            t0 = time.perf_counter()
            fn()
            self.sync()
            spent += time.perf_counter() - t0
        return spent / calls

    def record(self, kind: str, wire, uneven: bool, seconds: float, group: int | None = None) -> None:
        t = torch.tensor([seconds], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        self.out.append({"kind": kind, "group": group or self.n, "bytes": int(wire), "uneven": uneven,
                         "seconds": float(t.item())})

    def gathers(self, size: int) -> None:
        """All-gather and reduce-scatter of token shards, even and (where there are tokens to
        spare) uneven, the largest shard moving about `size` bytes in all."""
        n, width = self.n, self.WIDTH
        longest = max(1, size // (4 * width * (n - 1)))           # tokens of the largest shard
        for uneven in (False, True):
            if uneven and longest < 2:
                continue
            shares = [longest] * n if not uneven else [longest] + [max(1, longest // 2)] * (n - 1)
            x = torch.randn(1, shares[self.rank], width, device=self.device)
            full = torch.randn(1, sum(shares), width, device=self.device)
            wire = (n - 1) * longest * width * 4
            dist.barrier()
            self.record("all_gather", wire, uneven, self.timed(lambda: all_gather_sequence(x, shares, self.pg)))
            dist.barrier()
            self.record("reduce_scatter", wire, uneven,
                        self.timed(lambda: reduce_scatter_sequence(full, shares, self.rank, self.pg)))

    def all_reduce(self, size: int) -> None:
        n = self.n
        numel = max(n, size // (8 * (n - 1)) * n)
        y = torch.randn(numel, device=self.device)
        dist.barrier()
        self.record("all_reduce", 2 * (n - 1) * -(-numel // n) * 4, False, self.timed(lambda: all_reduce(y, self.pg)))

    def send_recv(self, size: int, a: int = 0, b: int = 1) -> None:
        z = torch.randn(max(1, size // 4), device=self.device)
        dist.barrier()

        def exchange():
            if self.rank == a:
                dist.send(z, dst=b)
            elif self.rank == b:
                dist.recv(z, src=a)
        # the other ranks call a no-op, as many times
        self.record("send_recv", z.numel() * 4, False, self.timed(exchange), group=2)


def measure_token_calls(env, sizes: list[int], repeats: int) -> list[dict]:
    """The calls a decode step makes, timed as measure_link times the others (after a burst of
    compute; the slowest rank's mean), at the few-KB sizes of one token: a TP sub-block's sum of
    one token's partial output by the engine's default token_sum on this device (kind
    "token_sum", bytes: the summed tensor's; on CPU the group's own sockets, galaxy.distributed.
    token_link, else sum_by_all_to_all), also at 16 bytes, a greedy row's pick of the split LM
    head (galaxy.inference.split_head.greedy_tokens: one exchange of [1, 2] float64), and the
    sampler's [1, 2] token broadcast from the last rank (kind "broadcast", 16 bytes). A one-token
    call's cost is its rounds of messages, which a fit to large messages does not give
    (bench/results/latency_cluster.md: 2.5 ms per all-reduce fitted, 0.1-0.2 ms per all-to-all)."""
    timer = _LinkTimer(env, repeats)
    if default_token_sum(timer.device) == SOCKET:
        summed = TokenLink.open(timer.pg).sum
    else:
        def summed(x):
            return sum_by_all_to_all(x, timer.pg)
    for size in [PICK_BYTES, *sizes]:
        x = torch.randn(1, 1, max(1, size // 4), device=timer.device)          # [b, 1, h]: one token
        dist.barrier()
        timer.record("token_sum", x.numel() * 4, False, timer.timed(lambda: summed(x)))
    packed = torch.zeros(1, 2, dtype=torch.long, device=timer.device)           # the sampler's (token, status)
    dist.barrier()
    timer.record("broadcast", packed.numel() * 8, False, timer.timed(lambda: dist.broadcast(packed, src=env.world - 1)))
    return timer.out


# a decode step's one-token sums: 4 KB (hidden 1024, fp32) and around it
TOKEN_SIZES = [1 << 10, 1 << 12, 1 << 14]


def measure_pairs(env, sizes: list[int], repeats: int) -> list[dict]:
    """A send timed between every pair of ranks, one pair at a time (PAIR entries of
    galaxy.planner.profiles): on unequal links a pipeline's neighbours and a subgroup's ring run at
    their own devices' rates, not at the world's slowest."""
    pairs = []
    for a in range(env.world):
        for b in range(a + 1, env.world):
            timer = _LinkTimer(env, repeats)
            for size in sizes:
                timer.send_recv(size, a, b)
            pairs.append(fit_pair(a, b, [{"bytes": m["bytes"], "seconds": m["seconds"]} for m in timer.out]))
    return pairs


# A pair's sends: a small one for the per-call latency, two large ones for the rate (at 100 Mbit/s
# 4 MiB take 0.35 s: every pair of 4 ranks in about 10 s).
PAIR_SIZES = [1 << 12, 1 << 20, 1 << 22]


def link_sizes(quick: bool) -> list[int]:
    return [1 << 12, 1 << 18, 1 << 22] if quick else [1 << k for k in range(10, 25, 2)]
