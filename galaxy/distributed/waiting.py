"""How a rank waits for a started collective: block on it, or poll it while yielding the core.

A blocking wait() on a CPU (gloo) collective puts the waiting thread to sleep; when the peer's data
arrives, the thread that handles it has to be woken on that core. On machines where an idle core
is halted (virtual machines especially), that wake-up waits for the next scheduler tick: measured
on this project's 2-core VM, a 4 KB all-reduce between two ranks took 0.2-0.5 ms when the waiter
polled and 2-4 ms (a 4 ms tick, half the time) when it slept. Polling keeps the core awake, so the
wake-up is immediate; os.sched_yield() between polls hands the core to gloo's own threads.

Polling spends the waiting time on the CPU, which is free only when every rank on a host has a
core of its own; with more ranks than cores it would steal time from the rank that is computing.
So the mode is chosen per run (config key comm_wait):

  block   work.wait(): always right; the only sensible mode on CUDA (NCCL waits are stream
          dependencies, polling would stall the host)
  poll    spin on work.is_completed() with sched_yield, for CPU collectives
  auto    poll when the backend is gloo and this host runs no more ranks than the cores they
          may use together (the union of their os.sched_getaffinity); else block

Some gloo works only complete inside wait(): is_completed() stays False for ever on a send, a
receive (isend / irecv, batch_isend_irecv) and gloo's own reduce-scatter (whose work reports no
operation type). So wait() polls only the operation types that report completion (POLLABLE_OPS,
checked on gloo by tests/test_transitions.py) and blocks on every other work; callers may also
pass pollable=False.
"""
from __future__ import annotations

import os

import torch.distributed as dist
from torch._C._distributed_c10d import OpType

from galaxy.config import choices

WAIT_MODES = choices("comm_wait")

# Collectives whose gloo works report completion to is_completed() (not SEND, RECV, UNKNOWN); as
# ints, which Work._get_op_type() returns.
POLLABLE_OPS = frozenset(int(t) for t in (OpType.BROADCAST, OpType.ALLREDUCE, OpType.ALLGATHER, OpType._ALLGATHER_BASE,
                                          OpType.ALLTOALL, OpType.ALLTOALL_BASE, OpType.BARRIER))

_poll = False


def choose_poll(mode: str, backend: str, ranks_on_host: int, cores_on_host: int) -> bool:
    """Whether waits poll, for a run's comm_wait mode: ranks_on_host ranks share cores_on_host cores
    (the union of their CPU affinities)."""
    if mode not in WAIT_MODES:
        raise ValueError(f"comm_wait must be one of {', '.join(WAIT_MODES)}, got {mode!r}")
    if backend != "gloo" or mode == "block":
        return False
    return mode == "poll" or ranks_on_host <= cores_on_host


def usable_core_ids() -> set[int]:
    """The cores this process may run on (all of them where affinity cannot be read)."""
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:              # not Linux
        return set(range(os.cpu_count() or 1))


def set_polling(on: bool) -> None:
    """Make every later wait() poll (True) or block (False); process-wide, set once per run."""
    global _poll
    _poll = bool(on)


def polling() -> bool:
    return _poll


def can_poll(work) -> bool:
    """Whether this work reports its completion to is_completed() (by its operation type)."""
    try:
        return int(work._get_op_type()) in POLLABLE_OPS
    except (AttributeError, RuntimeError):      # a Work without the (private) accessor: block
        return False


def wait(work, pollable: bool = True) -> None:
    """Wait for a started collective (a torch.distributed Work) in the run's mode; blocks on a
    work that cannot be polled, whatever the mode."""
    if _poll and pollable and can_poll(work):
        while not work.is_completed():
            os.sched_yield()
    work.wait()


def all_reduce(x, group=None, op=dist.ReduceOp.SUM):
    """dist.all_reduce(x) in place, waited for in the run's mode; returns x."""
    wait(dist.all_reduce(x, op=op, group=group, async_op=True))
    return x
