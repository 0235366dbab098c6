"""What the devices of a testbed deliver, measured by their ranks: run it as every device's command.

    python -m galaxy.edge run --cluster clusters/home3.json -- python -m galaxy.edge.probe link gemm
    python -m galaxy.edge run --cluster c.json -- python -m galaxy.edge.probe memory --mib 2000 --timeout_s 10

  link    rank 0 and every other device in turn send --bytes (4 MiB) each way through gloo, timed by
          the sender up to a one-element reply: the payload rate in Mbit/s (TCP/IP headers cost
          3-4% of the link), and the mean skb the sender's interface passed (bytes)
  gemm    each device in turn, alone, multiplies 256 x 256 matrices for --rounds windows of
          GEMM_WINDOW_S; its best window in GFLOP/s (the window least disturbed by the host's
          other work; a window spans 30 CFS periods, so a device's share shows whole)
  memory  the last device allocates --mib MiB, 1 MiB at a time, touched; the others wait for it
          in an all-reduce bounded by --timeout_s, as Galaxy's ranks wait for a peer

The collectives bind to the interface towards rank 0 as Galaxy's launch does
(galaxy.distributed.interface). Rank 0 prints a line per figure and, with --out, writes them as
JSON ({"0->1": Mbit/s, "skb 0->1": bytes, "gemm 1": GFLOP/s, "host 1": its host name, "threads 1": torch threads}).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from galaxy.distributed.interface import bind_to_rendezvous

GEMM_N, GEMM_WINDOW_S = 256, 0.3


def timed_send(peer: int, nbytes: int, sending: bool) -> float:
    """Seconds for nbytes to reach the receiver, timed by the sender up to a 1-element reply."""
    data, ack = torch.zeros(nbytes // 4, dtype=torch.float32), torch.zeros(1)
    t0 = time.perf_counter()
    if sending:
        dist.send(data, peer)
        dist.recv(ack, peer)
    else:
        dist.recv(data, peer)
        dist.send(ack, peer)
    return time.perf_counter() - t0


def interface_counts(iface: str) -> dict:
    """{"tx_bytes", "tx_skbs", "rx_bytes", "rx_skbs"} of `iface` in this network namespace
    (/proc/net/dev). A veth counts an skb once whatever its size, so bytes / skbs is the mean skb:
    tens of KB where TCP's TSO/GSO segments cross whole (galaxy.edge.shaping), 1.5 KB where a tbf
    cut them to wire packets."""
    for line in open("/proc/net/dev", encoding="ascii").read().splitlines()[2:]:
        name, counts = line.split(":", 1)
        if name.strip() == iface:
            f = [int(x) for x in counts.split()]
            return {"rx_bytes": f[0], "rx_skbs": f[1], "tx_bytes": f[8], "tx_skbs": f[9]}
    return {}


def link(rank: int, world: int, nbytes: int) -> dict:
    """{"i->0": Mbit/s, "0->i": Mbit/s} for every device i > 0, one pair at a time, and the mean
    skb the sender's interface passed meanwhile ({"skb i->0": bytes, ...})."""
    iface = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    out = {}
    for peer in range(1, world):
        for src, dst in ((peer, 0), (0, peer)):
            dist.barrier()
            if rank in (src, dst):
                other = dst if rank == src else src
                timed_send(other, 1 << 16, rank == src)         # the pair's connection is warm
                before = interface_counts(iface)
                seconds = timed_send(other, nbytes, rank == src)
                if rank == src:
                    after = interface_counts(iface)
                    out[f"{src}->{dst}"] = nbytes * 8 / seconds / 1e6
                    out[f"skb {src}->{dst}"] = ((after.get("tx_bytes", 0) - before.get("tx_bytes", 0))
                                                / max(1, after.get("tx_skbs", 0) - before.get("tx_skbs", 0)))
    return out


def gemm(rank: int, world: int, rounds: int) -> dict:
    """{"gemm <rank>": best GFLOP/s of `rounds` windows}; devices take turns, so none competes
    with another."""
    a, b = torch.randn(GEMM_N, GEMM_N), torch.randn(GEMM_N, GEMM_N)
    a @ b
    best = 0.0
    for _ in range(rounds):
        for turn in range(world):
            dist.barrier()
            if turn == rank:
                n, t0 = 0, time.perf_counter()
                while time.perf_counter() - t0 < GEMM_WINDOW_S:
                    a @ b
                    n += 1
                best = max(best, n * 2 * GEMM_N ** 3 / (time.perf_counter() - t0) / 1e9)
    return {f"gemm {rank}": best}


def memory(rank: int, world: int, mib: int) -> dict:
    """{"allocated <last rank>": MiB} if the last device survives holding mib MiB."""
    held = [torch.ones(2 ** 18) for _ in range(mib)] if rank == world - 1 else []   # 1 MiB each, written
    dist.all_reduce(torch.zeros(1))
    return {f"allocated {rank}": len(held)} if held else {}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m galaxy.edge.probe", description=__doc__.split("\n\n")[0])
    p.add_argument("modes", nargs="+", choices=("link", "gemm", "memory"))
    p.add_argument("--out", metavar="PATH", help="JSON file rank 0 writes the figures to")
    p.add_argument("--bytes", type=int, default=4 << 20, help="bytes per timed transfer (default 4 MiB)")
    p.add_argument("--rounds", type=int, default=5, help="gemm: timed windows per device (default 5)")
    p.add_argument("--mib", type=int, default=1024, help="memory: MiB the last device allocates")
    p.add_argument("--timeout_s", type=float, default=60, help="bound on every collective (default 60)")
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--init_method", required=True)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    bind_to_rendezvous(args.init_method)
    dist.init_process_group("gloo", init_method=args.init_method, rank=args.rank, world_size=args.world,
                            timeout=timedelta(seconds=args.timeout_s))
    mine = {f"host {args.rank}": socket.gethostname(), f"threads {args.rank}": torch.get_num_threads()}
    for mode in args.modes:
        if mode == "link":
            mine |= link(args.rank, args.world, args.bytes)
        elif mode == "gemm":
            mine |= gemm(args.rank, args.world, args.rounds)
        else:
            mine |= memory(args.rank, args.world, args.mib)
    every = [None] * args.world
    dist.all_gather_object(every, mine)
    figures = {k: v for d in every for k, v in d.items()}
    if args.rank == 0:
        for key, value in figures.items():
            unit = " B" if key.startswith("skb") else " Mbit/s" if "->" in key else " GFLOP/s" if key.startswith("gemm") else \
                " MiB" if key.startswith("allocated") else ""
            print(f"{key}: {value:.1f}{unit}" if isinstance(value, float) else f"{key}: {value}{unit}", flush=True)
        if args.out:
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump(figures, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
