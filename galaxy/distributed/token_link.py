"""Direct sockets between the ranks of a Galaxy group, for a decode step's small messages.

A decode step at batch 1 sends a few KB at every TP sub-block boundary (the one-token sums, 16 a
token for 8 layers) and the LM head's pick: their cost is latency, not bytes. Through gloo each
collective is handed to a worker thread of the process group, which sends, waits for its peers on
a condition variable woken by gloo's own network thread, and marks the work done for the caller's
wait: three thread hand-offs a message. Measured on the edge testbed (two_equal_1g, one core a
device, 4 KB, median of 400 exchanges): gloo's all-to-all 160 us, a plain TCP exchange on a
socket of its own 30 us, spinning or blocking alike.

So a TokenLink keeps one TCP connection (TCP_NODELAY) to every other rank of the group, made once
per engine (`open`, collective over the group), and `exchange` sends this rank's tensor to every
peer and receives theirs in the calling thread: non-blocking sockets, sends and receives
interleaved so that two ranks sending more than their socket buffers at each other cannot
deadlock. While nothing moves it spins (with sched_yield) when the run's waits poll
(galaxy.distributed.waiting), else it sleeps in select(). A peer that closes its end or stays
silent past the group's timeout raises, as a gloo collective would.

`sum` is sum_by_all_to_all's arithmetic (the n copies stacked in rank order, summed over dim 0):
the same bits on every rank, and the same as the all-to-all's. CPU tensors only (gloo's devices).
"""
from __future__ import annotations

import os
import select
import socket
import struct
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from galaxy.distributed import waiting

DEFAULT_TIMEOUT_S = 120.0        # Galaxy's timeout_s default, where the group's cannot be read


class TokenLinkError(RuntimeError):
    """A peer gone or silent: a RuntimeError naming the peer or the timeout, as gloo's failures
    read, so that the entry scripts exit 1 with one line (galaxy.launch)."""


def reachable_address() -> str:
    """The address peers reach this rank at: that of the interface gloo was pointed at
    (GLOO_SOCKET_IFNAME, galaxy.distributed.interface), else the host name's, as gloo offers it."""
    name = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    if name:
        import fcntl
        from galaxy.distributed.interface import SIOCGIFADDR
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
                return socket.inet_ntoa(raw[20:24])
            except OSError:         # no IPv4 address there: the host name's, as below
                pass
    return socket.gethostbyname(socket.gethostname())


def group_timeout(pg) -> float:
    """The process group's timeout in seconds (gloo's options; private, hence the fallback)."""
    try:
        t = pg._get_backend(torch.device("cpu")).options._timeout
        return t.total_seconds() if isinstance(t, timedelta) else DEFAULT_TIMEOUT_S
    except (AttributeError, RuntimeError):
        return DEFAULT_TIMEOUT_S


def _read_exactly(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = s.recv(n - len(data))
        if not part:
            raise TokenLinkError("a peer closed its token link while connecting (connection lost)")
        data += part
    return data


class TokenLink:
    """One TCP connection to every other rank of a group (two or more ranks)."""

    def __init__(self, rank: int, size: int, peers: dict[int, socket.socket], timeout: float):
        self.rank, self.size, self.peers, self.timeout = rank, size, peers, timeout

    @classmethod
    def open(cls, pg) -> "TokenLink":
        """Collective over the process group pg (a Galaxy group's, of two or more ranks): every
        rank listens, the addresses are all-gathered over pg, each rank dials the lower ranks and
        accepts the higher ones."""
        rank, size, timeout = dist.get_rank(pg), dist.get_world_size(pg), group_timeout(pg)
        listener = socket.create_server((reachable_address(), 0), backlog=size)
        listener.settimeout(timeout)
        every = [None] * size
        dist.all_gather_object(every, listener.getsockname()[:2], group=pg)
        peers = {}
        for r in range(rank):
            s = socket.create_connection(tuple(every[r]), timeout=timeout)
            s.sendall(struct.pack("!i", rank))
            peers[r] = s
        for _ in range(size - 1 - rank):
            s, _ = listener.accept()
            s.settimeout(timeout)
            peers[struct.unpack("!i", _read_exactly(s, 4))[0]] = s
        listener.close()
        for s in peers.values():
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.setblocking(False)
        return cls(rank, size, dict(sorted(peers.items())), timeout)

    def exchange(self, x: torch.Tensor, shapes=None) -> list[torch.Tensor]:
        """Every rank's x, in rank order (this rank's own x at its place); shapes[r]: rank r's
        shape where they differ (default: all x's). x: a CPU tensor."""
        x = x.contiguous()
        shapes = shapes or [x.shape] * self.size
        got = [x if r == self.rank else torch.empty(shapes[r], dtype=x.dtype) for r in range(self.size)]
        try:
            self._swap(_bytes(x), {r: _bytes(got[r]) for r in self.peers})
        except OSError as e:              # a reset or broken connection: the peer died
            raise TokenLinkError(f"a peer's token link failed (connection lost): {e}") from e
        return got

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the group: the copies stacked in rank order and summed over dim 0 (two:
        one addition in rank order, the same value without the stack's copy)."""
        every = self.exchange(x)
        return every[0] + every[1] if self.size == 2 else torch.stack(every).sum(0)

    def sum_over(self, x: torch.Tensor, group=None) -> torch.Tensor:
        """sum(x) in a Transition's signature fn(x, group) (galaxy.parallel.decode_layout)."""
        return self.sum(x)

    def _swap(self, out: memoryview, ins: dict[int, memoryview]) -> None:
        """Send `out` to every peer and fill ins[r] from peer r, interleaved, until all is moved."""
        sent = dict.fromkeys(self.peers, 0)
        got = dict.fromkeys(self.peers, 0)
        deadline, spin = time.monotonic() + self.timeout, waiting.polling()
        while True:
            moved = False
            for r, s in self.peers.items():
                if sent[r] < len(out):
                    try:
                        sent[r] += s.send(out[sent[r]:])
                        moved = True
                    except BlockingIOError:
                        pass
                if got[r] < len(ins[r]):
                    try:
                        n = s.recv_into(ins[r][got[r]:])
                    except BlockingIOError:
                        continue
                    if n == 0:
                        raise TokenLinkError(f"peer rank {r} closed its token link (connection lost)")
                    got[r] += n
                    moved = True
            reading = [s for r, s in self.peers.items() if got[r] < len(ins[r])]
            writing = [s for r, s in self.peers.items() if sent[r] < len(out)]
            if not reading and not writing:
                return
            if moved:       # the timeout counts silence, not the whole exchange (megabytes may take long)
                deadline = time.monotonic() + self.timeout
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                raise TokenLinkError(f"the token link's peers sent nothing for {self.timeout:g} s: timed out")
            if spin:
                os.sched_yield()
            else:
                select.select(reading, writing, [], left)

    def close(self) -> None:
        for s in self.peers.values():
            s.close()
        self.peers = {}


def _bytes(t: torch.Tensor) -> memoryview:
    """t's storage as bytes (t contiguous, on the CPU; any dtype, bf16 too), without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())
