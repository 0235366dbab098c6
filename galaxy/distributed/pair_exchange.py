"""A two-rank gloo group's all-gather and reduce-scatter as one paired exchange, receive first.

gloo's TCP transport moves a message only after the receiver has said it is ready (a small
"recv ready" note on the same TCP stream that carries the data). Its collectives post each send
before the matching receive (all-gather: send then receive, per half; all-to-all: the same), so a
rank that reaches a collective after its peer finds the peer's receive already posted, writes its
whole message, and only then its own "recv ready": the note waits behind the data in the socket
and the link's queue, and the peer's data leaves only once ours has arrived. The two directions
run one after the other. Measured on the edge testbed (bench/link_collectives.py, two one-core
devices at 300 Mbit/s, 0.8-8 MB): called together, gloo's all-gather and all-to-all carried up to
91-93% of the link each way; called back to back after compute, as the layers call them, the
all-to-all's slower direction fell to 46-49% and the all-gather's (two halves) to 60-64%. A real
link of that rate behaves the same: the order is gloo's, the wait is the link's. Received first,
the same step pattern keeps 93-94% both ways.

Here each rank posts its receive before its send (dist.irecv, then dist.isend): the note leaves
ahead of the data whichever rank comes second, and both directions travel at once. The bytes are
those of gloo's all-gather and of the all-to-all reduce-scatter (one block each way); the results
are bit-identical to theirs (one copy of the rank's own block; the reduce-scatter's two blocks
summed in rank order). gloo's send and receive works report completion only inside wait(), so the
Pending is not pollable (galaxy.distributed.waiting blocks on it).

Groups that met at a loopback address (every rank on this host, as the test suite runs) keep
gloo's collectives: there is no link rate to lose, and gloo's own cost less at every size
(bench/pair_exchange_sizes.py, 1 KB-1 MB each way; figures in bench/README.md). No
message size divides the two cases: over the testbed's 300 Mbit/s link the exchange was faster
at every size from 16 KB when the ranks call it idle (16 KB: 0.37 against 1.9 ms), level with
gloo's at 16-64 KB and faster from 128 KB when they call it in a step (128 KB: 3.0 against 4.1 ms).
"""
from __future__ import annotations

import functools
import ipaddress
import socket

import torch
import torch.distributed as dist

# False (tests and benches only): gloo's own all-gather and all-to-all for every two-rank group.
enabled = True
# True (tests and benches only): the exchange over loopback too.
over_loopback = False


def applies(pg) -> bool:
    """Whether pg's collectives go through the paired exchange: a gloo group of two ranks that
    did not meet at a loopback address (every rank met at the same one, so all decide alike)."""
    return (enabled and dist.get_world_size(pg) == 2 and dist.get_backend(pg) == "gloo"
            and (over_loopback or not met_on_loopback()))


def met_on_loopback() -> bool:
    """Whether the default process group's rendezvous (its TCP store) is at a loopback address;
    False where it has no TCP store (a file:// rendezvous)."""
    store = dist.distributed_c10d._get_default_store()
    while store is not None and not hasattr(store, "host"):      # PrefixStores wrap the TCPStore
        store = getattr(store, "underlying_store", None)
    return store is not None and is_loopback(store.host)


@functools.lru_cache(maxsize=None)
def is_loopback(host: str) -> bool:
    """Whether host (an address or a name) is a loopback address."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except OSError:
        return False


class Exchanged:
    """The receive and send works of one exchange; wait() waits for both."""

    def __init__(self, works):
        self.works = works

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        return True


def _exchange(send: torch.Tensor, recv: torch.Tensor, pg) -> Exchanged:
    """Post the receive of the peer's `recv` first, then the send of `send` (both contiguous)."""
    peer = dist.get_global_rank(pg, 1 - dist.get_rank(pg))
    received = dist.irecv(recv, peer, group=pg)
    return Exchanged([received, dist.isend(send, peer, group=pg)])


def start_all_gather(flat: torch.Tensor, x: torch.Tensor, pg) -> Exchanged:
    """flat [2 * b, ...] = the two ranks' x [b, ...] in rank order (gloo's all_gather_into_tensor)."""
    rank, b = dist.get_rank(pg), x.shape[0]
    flat.narrow(0, rank * b, b).copy_(x)
    return _exchange(x, flat.narrow(0, (1 - rank) * b, b), pg)


def start_reduce_scatter(out: torch.Tensor, blocks: torch.Tensor, pg):
    """out = blocks[rank] of rank 0 + blocks[rank] of rank 1 (blocks: [2, ...] rank blocks), summed in
    rank order as the all-to-all path sums them; returns (the started work, its finish)."""
    rank = dist.get_rank(pg)
    peers = torch.empty_like(out)                            # the peer's block for this rank
    work = _exchange(blocks[1 - rank].contiguous(), peers, pg)
    mine = blocks[rank]
    first, second = (mine, peers) if rank == 0 else (peers, mine)
    return work, lambda: torch.add(first, second, out=out)
