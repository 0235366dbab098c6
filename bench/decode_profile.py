"""Where a tp decode step's time goes on every rank (decode_bound.py --profile).

torch.profiler over Galaxy's engine under the tp preset (even shares) on inference_latency.py's
Llama, one decode token = (run of 1 + new tokens - run of 1) / new, prompt 32. Self time split:

  products            aten::mm / addmm / bmm / attention kernels
  other ops           every other aten operator (norms, views, copies, the sampler's argmax ...)
  collective calls    the operators that start a collective (c10d::*, gloo:*)
  collective waits    waiting.wait (polled or blocking) and the sampler's blocking broadcast,
                      each wrapped in a named range for this run only
  token link          the token link's exchanges (token_sum socket, the default on CPU: the
                      sums and the greedy pick), sends and waits together, in a named range
  Python              the step's wall time outside any operator or range
"""
from __future__ import annotations

import statistics
import tempfile
import time
from collections import Counter
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from decode_bound import COLLECTIVE, PRODUCTS, WAIT_RANGE
from inference_latency import SHAPE, run_galaxy, write_model


LINK_RANGE = "bench::token_link"


@contextmanager
def waits_named():
    """waiting.wait and dist.broadcast inside a named range while profiling; the token link's
    exchanges (galaxy.distributed.token_link: sends, and waits for the peers', in the calling
    thread) inside another."""
    from galaxy.distributed import waiting
    from galaxy.distributed.token_link import TokenLink
    wait, broadcast, swap = waiting.wait, dist.broadcast, TokenLink._swap

    def named_swap(link, out, ins):
        with record_function(LINK_RANGE):
            swap(link, out, ins)

    def named_wait(work, pollable=True):
        with record_function(WAIT_RANGE):
            wait(work, pollable)

    def named_broadcast(*a, **k):
        with record_function(WAIT_RANGE):
            return broadcast(*a, **k)
    waiting.wait, dist.broadcast, TokenLink._swap = named_wait, named_broadcast, named_swap
    try:
        yield
    finally:
        waiting.wait, dist.broadcast, TokenLink._swap = wait, broadcast, swap


def self_times(engine, ids, new) -> tuple[Counter, float]:
    """Self microseconds per category of one run, and its wall microseconds."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        dist.barrier()
        start = time.perf_counter()
        run_galaxy(engine, ids, new)
        wall = (time.perf_counter() - start) * 1e6
    kinds = Counter()
    for e in prof.events():
        n = e.name
        kind = ("collective waits" if n == WAIT_RANGE else "token link" if n == LINK_RANGE
                else "products" if n.startswith(PRODUCTS)
                else "collective calls" if n.startswith(COLLECTIVE) else "other ops")
        kinds[kind] += e.self_cpu_time_total
    return kinds, wall


def profile_tp_decode(args) -> list[dict]:
    """Per rank: ms a decode token by category (medians of 3 profiled pairs); printed by rank 0."""
    from galaxy.distributed import waiting
    from galaxy.launch import ranks_and_cores_on_this_host
    from galaxy.plan import Plan
    from inference_plans import engine_for
    waiting.set_polling(waiting.choose_poll(args.comm_wait, "gloo", *ranks_and_cores_on_this_host()))
    with tempfile.TemporaryDirectory() as own:
        path = [own]
        if dist.get_rank() == 0:
            write_model(own)
        dist.broadcast_object_list(path, src=0)
        engine = engine_for(path[0], Plan.preset("tp"), dist.get_world_size(), 32, args.token_sum)
        ids = [1] + list(range(3, 34))
        run_galaxy(engine, ids, 3)
        per_token = []
        with torch.no_grad(), waits_named():
            for _ in range(3):
                (one, wall1), (many, wall_n) = self_times(engine, ids, 1), self_times(engine, ids, 1 + args.new)
                ms = {k: (many[k] - one[k]) / args.new / 1e3 for k in many}
                ms["wall"] = (wall_n - wall1) / args.new / 1e3
                per_token.append(ms)
        dist.barrier()
    result = {k: statistics.median(t[k] for t in per_token) for k in per_token[0]}
    result["Python"] = result["wall"] - sum(v for k, v in result.items() if k != "wall")
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, result)
    if dist.get_rank() == 0:
        print(f"tp decode step under torch.profiler, ms a token ({SHAPE['num_hidden_layers']} layers), rank 0 / 1 ...:")
        for k in ("wall", "products", "other ops", "collective calls", "collective waits", "token link", "Python"):
            print(f"  {k:<17} " + "  ".join(f"{r.get(k, 0.0):7.2f}" for r in everyone))
    return everyone
