"""One long-lived group of spawned processes (gloo over loopback) that runs many test cases.

Spawning and rendezvous cost seconds; a case costs milliseconds. A test calls
`pool.run(fn, *args)`: every rank runs `fn(*args)` (fn must be a module-level function of an
importable module) and the per-rank return values come back as a list. An exception on any
rank fails the test with that rank's traceback; a case that hangs is killed after `timeout` and
the pool is started again for the next case.

Every case builds its own process groups (meshes, Galaxy groups), and they stay: destroying them
after each case made a later FSDP case hang on a collective (torch keeps state that outlives a
case's mesh; DTensor's sharding cache hands back an earlier, equal DeviceMesh, but emptying it was
not enough). But each live gloo group costs an idle worker about 0.1% of a core (its socket loop
wakes on its own; measured: 300 groups, 32% of a core per worker), and every later test pays for
it. So a pool whose workers hold more than GROUP_LIMIT groups starts afresh after the case.

Workers are forked from one forkserver that has imported torch, transformers' model classes,
galaxy and the test runners once (PRELOAD): a spawned worker spent seconds importing them, and
every pool size and every fresh start paid that again (about 30 restarts a suite). The forkserver
runs no collective and starts no thread pool before it forks, so a worker starts as a spawned one
would, less the imports.
"""
from __future__ import annotations

import os
import queue
import random
import socket
import sys
import traceback

import torch.multiprocessing as mp

GROUP_LIMIT = 48
PRELOAD = ["torch", "torch.distributed", "transformers", "peft",
           "transformers.models.bert.modeling_bert", "transformers.models.llama.modeling_llama",
           "transformers.models.qwen2.modeling_qwen2", "transformers.models.gpt2.modeling_gpt2",
           "galaxy.runtime.assemble", "support.parity_runners", "support.peft_runners"]


_HANDED_OUT: set[int] = set()     # ports free_port has returned in this process
LAUNCH_RANK: int | None = None    # in a worker: the rank it was started as (launch_rank())


def launch_rank() -> int:
    """In a pool worker: the rank it was started as, which a pool with an order places at another
    mesh position (the group's rank)."""
    return LAUNCH_RANK


def free_port() -> int:
    """A loopback port free now, drawn from below the kernel's ephemeral range.

    A port the kernel hands out for bind(0) comes from the ephemeral range, which it also hands to
    every outgoing connection (gloo opens one per peer pair); a test that picks ports for jobs it
    starts minutes later would then find one taken. Ports below the range are only ever bound on
    purpose. A port is handed out once per process: a test that draws ports for many jobs at once
    (test_readme_commands: 40) would otherwise give two jobs the same one about one time in 20.
    """
    low = _ephemeral_low()
    draw = random.SystemRandom()
    for _ in range(200):
        port = draw.randrange(max(1024, low - 12000), low)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError(f"no free loopback port below {low}")


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):   # not Linux: IANA's dynamic range starts at 49152
        return 49152


def _worker(rank, world, port, tasks, results, path, order=None):
    sys.path[:] = path
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    global LAUNCH_RANK
    LAUNCH_RANK = rank
    if order is None:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    else:
        _init_as_launched(rank, world, port, order)
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            result = (rank, True, fn(*args))
        except BaseException:  # report everything, keep serving
            result = (rank, False, traceback.format_exc())
        results.put((*result, len(dist.distributed_c10d._world.pg_map)))    # groups held now
    dist.destroy_process_group()


def _init_as_launched(rank, world, port, order):
    """Join the group as an entry script does (galaxy.launch.init_distributed) with mesh_rank_order
    `order`: `rank` is the launch rank, the group's rank the mesh position the order gives it."""
    import argparse

    from galaxy.config import GalaxyConfig
    from galaxy.launch import init_distributed
    cfg = GalaxyConfig(mesh_rank_order=list(order), distributed_backend="gloo", comm_wait="block",
                       cpu_allocator="system")
    args = argparse.Namespace(rank=rank, world=world, init_method=f"tcp://127.0.0.1:{port}", local_rank=None)
    env = init_distributed(cfg, args)
    assert (env.launch_rank, env.rank) == (rank, order.index(rank)), (env.launch_rank, env.rank)


class DistPool:
    """Workers report by launch rank: run() returns their values in launch-rank order. With
    `order` (a mesh_rank_order), the worker started as rank R holds mesh position order.index(R)."""

    def __init__(self, world: int, order: tuple[int, ...] | None = None):
        self.world, self.order = world, order
        self.procs = []
        self._start()

    def _start(self):
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)     # read when the forkserver starts: once a session
        port = free_port()
        self.tasks = [ctx.Queue() for _ in range(self.world)]
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=_worker, daemon=True,
                                  args=(r, self.world, port, self.tasks[r], self.results, list(sys.path),
                                        self.order))
                      for r in range(self.world)]
        for p in self.procs:
            p.start()

    def run(self, fn, *args, timeout: float = 300):
        for q in self.tasks:
            q.put((fn, args))
        out, errors, groups = [None] * self.world, [], 0
        for _ in range(self.world):
            try:
                rank, ok, value, held = self.results.get(timeout=timeout)
            except queue.Empty:
                self.close(force=True)
                self._start()
                raise AssertionError(f"{fn.__name__} did not finish on all ranks within {timeout}s") from None
            groups = max(groups, held)
            if ok:
                out[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
        if groups > GROUP_LIMIT:     # start afresh; the new workers start up while the test goes on
            self.close()
            self._start()
        if errors:
            raise AssertionError("\n".join(errors))
        return out

    def close(self, force: bool = False):
        for p, q in zip(self.procs, self.tasks):
            if force:
                p.kill()
            else:
                q.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


_POOLS: dict = {}


def pool_of(world: int, order: tuple[int, ...] | None = None) -> DistPool:
    """The session's pool of that size (conftest's dist_pool fixture), started when first asked;
    order: its workers placed by that mesh_rank_order (a pool of its own)."""
    key = world if order is None else (world, tuple(order))
    if key not in _POOLS:
        _POOLS[key] = DistPool(world, order)
    return _POOLS[key]


def close_pools() -> None:
    """Stop every pool's workers; pool_of starts them again when next asked (in about a second:
    they fork from the preloaded forkserver). Their gloo groups' socket loops keep idle workers busy
    for a few percent of a core each: timing tests call this first to have the host quiet."""
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
