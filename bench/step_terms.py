"""Where one training step's time goes on a rank: kernels, Python (and dispatch), and the time the
rank sits blocked in communication or waiting for its peer.

Measured on two steps of the same runner, one thread per rank, waits blocking (a polled wait
would spend the waiting time on the CPU and hide it in the thread's CPU time):

  wall      the step's wall time on this rank (and, over ranks, the slower one's)
  cpu       the main thread's CPU time in the same step (time.thread_time): what the rank
            computed, in kernels or in Python; gloo's own threads are not in it
  blocked   wall - cpu: the main thread off the CPU, i.e. waiting for a collective to finish
            (its transfer on the link, and the peer's lateness: a rank that is ahead waits)
  kernels   the summed self time of the aten ops of a second step run under torch.profiler
            (matrix products, softmax, norms, copies; collectives and DTensor's dispatch
            levels excluded, see kernel_seconds): the arithmetic
  python    cpu - kernels: Python, autograd and dispatch (DTensor's sharding propagation and
            redistribution bookkeeping are here)
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

# Leaf ops that are communication, not arithmetic (functional collectives, c10d, gloo).
COMM_MARKERS = ("c10d", "gloo", "wait_tensor", "all_gather", "all_reduce", "reduce_scatter", "barrier")


def kernel_seconds(step) -> float:
    """Summed self time of the aten ops of one profiled `step()`, collectives excluded. An op
    whose child is the same op (DTensor's dispatch of aten::mm runs the local aten::mm inside
    it) counts through the child only: the outer level's own time is dispatch, not arithmetic."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    total = 0.0
    for evt in prof.events():
        if not evt.name.startswith("aten::") or any(m in evt.name for m in COMM_MARKERS):
            continue
        if any(child.name == evt.name for child in evt.cpu_children):
            continue
        total += evt.self_cpu_time_total / 1e6
    return total


def step_terms(step, set_polling) -> dict:
    """This rank's terms of one `step()` (module docstring), in ms, with the slower rank's wall."""
    set_polling(False)
    dist.barrier()
    t0, c0 = time.perf_counter(), time.thread_time()
    step()
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    slower = torch.tensor(wall, dtype=torch.float64)
    dist.all_reduce(slower, op=dist.ReduceOp.MAX)
    dist.barrier()
    kernels = kernel_seconds(step)
    return {"wall_ms": 1e3 * wall, "slower_wall_ms": 1e3 * slower.item(), "cpu_ms": 1e3 * cpu,
            "blocked_ms": 1e3 * (wall - cpu), "kernels_ms": 1e3 * kernels, "python_ms": 1e3 * (cpu - kernels)}


def all_ranks_terms(step, set_polling) -> list[dict]:
    """step_terms of every rank, in rank order (collective)."""
    mine = step_terms(step, set_polling)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def print_terms(terms: dict) -> None:
    """{name: all_ranks_terms(...)}, one line per name."""
    print("one step's terms, ms per rank (waits block; bench/step_terms.py): "
          "wall = kernels + python + blocked (communication and waits on the peer)")
    for name, ranks in terms.items():
        print(f"{name:>12}: " + "   ".join(
            f"r{r} wall {t['wall_ms']:.0f} kernels {t['kernels_ms']:.0f} python {t['python_ms']:.0f} "
            f"blocked {t['blocked_ms']:.0f}" for r, t in enumerate(ranks)))
