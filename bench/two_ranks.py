"""Start a world-2 bench's two ranks: spawned here over loopback, or one rank per device on the
edge testbed.

A bench's `worker(rank, args, init_method, results)` runs one rank; rank 0 puts its figures on
`results`. Run as usual, `run_two` spawns both ranks on 127.0.0.1 and returns rank 0's figures.
Started by `python -m galaxy.edge run --cluster FILE -- python bench/X.py ...`, which appends
`--world 2 --rank R --init_method tcp://HOST:PORT` to the command on every device, this process
is rank R: it runs the worker itself (its collectives cross the shaped link, its CPU share and
memory are the device's), and `run_two` returns rank 0's figures on rank 0, None on the others.
"""
from __future__ import annotations

import socket

import torch.multiprocessing as mp


def add_rank_args(parser) -> None:
    """The arguments galaxy.edge run appends (also usable by hand, one process per machine)."""
    parser.add_argument("--world", type=int, default=None, help="set by galaxy.edge run: 2")
    parser.add_argument("--rank", type=int, default=None, help="set by galaxy.edge run: this device's rank")
    parser.add_argument("--init_method", default=None, help="set by galaxy.edge run: tcp://HOST:PORT of rank 0")


class _Kept:
    """A results 'queue' for a rank that runs in this process."""

    def __init__(self):
        self.value = None

    def put(self, value) -> None:
        self.value = value


def run_two(worker, args):
    """Rank 0's figures (None on a testbed rank other than 0); see the module docstring."""
    if args.rank is not None:
        if args.world != 2 or args.rank not in (0, 1) or not args.init_method:
            raise SystemExit(f"this bench runs on 2 ranks: --world 2 --rank 0|1 --init_method URL "
                             f"(got --world {args.world} --rank {args.rank} --init_method {args.init_method})")
        from galaxy.distributed.interface import bind_to_rendezvous
        bind_to_rendezvous(args.init_method)     # gloo offers the address towards rank 0, not loopback
        kept = _Kept()
        worker(args.rank, args, args.init_method, kept)
        return kept.value
    return spawn_two(worker, args)


def spawn_two(worker, *extra):
    """Runs worker(rank, *extra, init_method, results) in two spawned processes over loopback;
    returns what rank 0 put on `results`."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, *extra, f"tcp://127.0.0.1:{port}", results)) for r in range(2)]
    for proc in procs:
        proc.start()
    value = results.get()
    for proc in procs:
        proc.join()
    return value
