"""Every layout transition, forward and backward, against a single-process reference.

The reference value is a full tensor X; the reference loss is sum(X * W), so dL/dX = W.
Each rank holds X in the source layout (R: X; S: its token range; P: a random summand, the
summands adding up to X), applies the transition, and computes its share of the loss in the
destination layout:
  S                     sum(y * W[own tokens])          (shares add up to the loss)
  R, replicated consumer sum(y * W)                     (every rank computes the whole loss)
  R, sharded consumer    sum(y * W_r), sum_r W_r = W    (partial losses, as a TP projection)
Then the forward value must be X in the destination layout, and the input gradient must be
W in the source layout (P and R sources need the full W on every rank).
The uneven cases wait for their collectives by polling (galaxy.distributed.waiting) and reduce-scatter
as gloo runs it in training (an all-to-all and a local sum); the even ones block and use the
backend's own reduce-scatter (NCCL's path): both ways of waiting and of reducing, every transition.
"""
import pytest
import torch
import torch.distributed as dist

from galaxy.distributed import transitions as T
from galaxy.distributed import collectives, pair_exchange, waiting
from galaxy.distributed.group import GalaxyGroup
from galaxy.distributed.token_link import TokenLink
from galaxy.distributed.transitions import Layout

CASES = [  # (function, source, destination, consumer is sharded)
    (T.reduce_to_replicated, "P", "R", False),
    (T.reduce_scatter_to_shards, "P", "S", False),
    (T.gather_for_replicated_consumer, "S", "R", False),
    (T.gather_for_sharded_consumer, "S", "R", True),
    (T.copy_for_sharded_consumer, "R", "R", True),
    (T.split_to_shards, "R", "S", False),
]
SPLITS = {2: [(5, 5), (7, 3)], 3: [(4, 3, 3), (6, 1, 3)]}


def _shard(t, seq, rank):
    start = sum(seq[:rank])
    return t[:, start:start + seq[rank]]


def check_transition(case_index, seq, poll):
    waiting.set_polling(poll)
    collectives.reduce_scatter_as_all_to_all = poll     # blocking cases: the backend's own reduce-scatter
    try:
        return _check_transition(case_index, seq)
    finally:
        waiting.set_polling(False)
        collectives.reduce_scatter_as_all_to_all = True


def _check_transition(case_index, seq):
    fn, src, dst, sharded = CASES[case_index]
    rank, world = dist.get_rank(), dist.get_world_size()
    group = GalaxyGroup(rank, world, dist.group.WORLD, (1,) * world, (1,) * world, tuple(seq))
    g = torch.Generator().manual_seed(1234)                 # same on every rank
    b, s, h = 2, sum(seq), 5
    summands = [torch.randn(b, s, h, generator=g, dtype=torch.float64) for _ in range(world)]
    X = sum(summands)
    W = torch.randn(b, s, h, generator=g, dtype=torch.float64)
    W_parts = [torch.randn(b, s, h, generator=g, dtype=torch.float64) for _ in range(world - 1)]
    W_parts.append(W - sum(W_parts, torch.zeros_like(W)))

    x = {"P": summands[rank], "S": _shard(X, seq, rank), "R": X}[src].clone().requires_grad_()
    y = fn(x, group)
    if dst == "S":
        loss = (y * _shard(W, seq, rank)).sum()
    elif sharded:
        loss = (y * W_parts[rank]).sum()
    else:
        loss = (y * W).sum()
    loss.backward()

    want_y = _shard(X, seq, rank) if dst == "S" else X
    want_grad = _shard(W, seq, rank) if src == "S" else W
    return ((y - want_y).abs().max().item(), (x.grad - want_grad).abs().max().item())


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("uneven", [False, True], ids=["even", "uneven"])
@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{c[1]}->{c[2]}{'-tp' if c[3] else ''}" for c in CASES])
def test_transition_matches_reference(dist_pool, world, uneven, case):
    seq = SPLITS[world][int(uneven)]
    for rank, (fwd_err, bwd_err) in enumerate(dist_pool(world).run(check_transition, case, seq, uneven)):
        assert fwd_err < 1e-12, f"rank {rank}: forward off by {fwd_err}"
        assert bwd_err < 1e-12, f"rank {rank}: backward off by {bwd_err}"


def test_pick_transition_covers_every_layout_pair():
    assert T.pick_transition(Layout.S, Layout.S, False) is None
    assert T.pick_transition(Layout.R, Layout.R, False) is None
    assert T.pick_transition(Layout.P, Layout.S, False) is T.reduce_scatter_to_shards
    assert T.pick_transition(Layout.S, Layout.R, True) is T.gather_for_sharded_consumer
    with pytest.raises(ValueError):
        T.pick_transition(Layout.R, Layout.P, False)


def test_auto_wait_polls_only_on_gloo_with_a_core_per_rank():
    assert waiting.choose_poll("auto", "gloo", ranks_on_host=2, cores_on_host=2)
    assert not waiting.choose_poll("auto", "gloo", ranks_on_host=4, cores_on_host=2)     # would steal a computing rank's core
    assert not waiting.choose_poll("auto", "nccl", ranks_on_host=1, cores_on_host=8)     # NCCL waits are stream dependencies
    assert waiting.choose_poll("poll", "gloo", ranks_on_host=4, cores_on_host=2)
    assert not waiting.choose_poll("poll", "nccl", ranks_on_host=1, cores_on_host=8)
    assert not waiting.choose_poll("block", "gloo", ranks_on_host=1, cores_on_host=8)
    with pytest.raises(ValueError, match="comm_wait"):
        waiting.choose_poll("spin", "gloo", 1, 1)


def token_sums_on_rank(names, poll):
    """Every named one-token sum (TOKEN_SUMS) of this rank's fp32 summand of a [3, 1, 16] token:
    (its largest error against the float64 sum, the result) per name."""
    waiting.set_polling(poll)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        group = GalaxyGroup(rank, world, dist.group.WORLD, (1,) * world, (1,) * world, (1,) * world)
        g = torch.Generator().manual_seed(99)                      # same on every rank
        summands = [torch.randn(3, 1, 16, generator=g) for _ in range(world)]
        want = sum(s.double() for s in summands)
        out = {}
        for name in names:
            summed = TokenLink.open(group.pg).sum_over if name == "socket" else T.TOKEN_SUMS[name]
            got = summed(summands[rank].clone(), group)
            out[name] = ((got.double() - want).abs().max().item() / want.abs().max().item(), got)
        return out
    finally:
        waiting.set_polling(False)


@pytest.mark.parametrize("world", [2, 3])
def test_a_decoded_tokens_sum_is_the_same_on_every_rank_by_every_primitive(dist_pool, world):
    """The decode phase's P -> R of one token (galaxy.parallel.decode_layout): the all-to-all
    (polled), the group's own sockets (galaxy.distributed.token_link, spinning), the paired
    exchange (world 2) and the all-reduce give the sum within fp32 rounding, and every rank holds
    the same bits; the sockets' are the all-to-all's, bit for bit."""
    names = ["all_to_all", "socket", "all_reduce"] + (["exchange"] if world == 2 else [])
    results = dist_pool(world).run(token_sums_on_rank, names, True)
    for name in names:
        for rank, per_name in enumerate(results):
            err, got = per_name[name]
            assert err < 1e-6, f"{name} rank {rank}: off by {err:.2e} relative"
            assert torch.equal(got, results[0][name][1]), f"{name}: rank {rank} holds other bits than rank 0"
    assert torch.equal(results[0]["socket"][1], results[0]["all_to_all"][1])


def token_link_on_rank(spin):
    """Over a TokenLink of the world: an exchange of shapes that differ by rank, one of 4 MB each
    way (more than both socket buffers: sends and receives must interleave), and what rank 1
    reads once rank 0 closes its end."""
    waiting.set_polling(spin)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        link = TokenLink.open(dist.group.WORLD)
        shapes = [(2, 3 + r) for r in range(world)]
        uneven = link.exchange(torch.full(shapes[rank], float(rank)), shapes)
        big = link.exchange(torch.arange(1 << 20, dtype=torch.float32) + rank)     # 4 MB
        dist.barrier()
        if rank == 0:
            link.close()
            return uneven, big, None
        try:
            link.exchange(torch.zeros(4))
            return uneven, big, "no error"
        except RuntimeError as e:
            return uneven, big, f"{type(e).__name__}: {e}"
    finally:
        waiting.set_polling(False)


@pytest.mark.parametrize("spin", [True, False])
def test_a_token_link_exchanges_any_shapes_and_sizes_and_names_a_lost_peer(dist_pool, spin):
    """galaxy.distributed.token_link: every rank gets every rank's tensor in rank order, whatever
    their shapes and however large (no deadlock past the socket buffers), spinning or sleeping in
    select; a peer that closes its end is a RuntimeError naming the lost connection (the entry
    scripts' one-line exit 1), not a hang."""
    results = dist_pool(2).run(token_link_on_rank, spin)
    for uneven, big, _ in results:
        assert [t.shape for t in uneven] == [(2, 3), (2, 4)]
        assert [t.unique().tolist() for t in uneven] == [[0.0], [1.0]]
        for r, t in enumerate(big):
            assert torch.equal(t, torch.arange(1 << 20, dtype=torch.float32) + r)
    assert results[1][2].startswith("TokenLinkError") and "connection lost" in results[1][2]


def polled_waits_on_rank():
    """Under a polling wait mode, which works waiting.wait polls, and that it returns on a paired
    send and receive (gloo's never report completion to is_completed())."""
    waiting.set_polling(True)
    try:
        rank = dist.get_rank()
        x, got = torch.full((4,), float(rank)), torch.empty(4)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, 1 - rank), dist.P2POp(dist.irecv, got, 1 - rank)])
        flags = {"send/recv": [waiting.can_poll(w) for w in works]}
        for w in works:
            waiting.wait(w)
        a2a = dist.all_to_all_single(torch.empty(2), torch.ones(2), async_op=True)
        flags["all_to_all"] = waiting.can_poll(a2a)
        waiting.wait(a2a)
        scatter = dist.reduce_scatter_tensor(torch.empty(2), torch.ones(4), async_op=True)
        flags["gloo reduce_scatter"] = waiting.can_poll(scatter)
        waiting.wait(scatter)
        return flags, got.tolist()
    finally:
        waiting.set_polling(False)


def test_a_polling_wait_blocks_on_works_that_cannot_be_polled(dist_pool):
    """waiting.wait polls only works that report completion; gloo's send / receive (the exchange
    token sum) and its own reduce-scatter block instead of spinning for ever."""
    results = dist_pool(2).run(polled_waits_on_rank)
    for rank, (flags, got) in enumerate(results):
        assert flags == {"send/recv": [False, False], "all_to_all": True, "gloo reduce_scatter": False}
        assert got == [float(1 - rank)] * 4


def exchanged_and_gloos_on_rank(sizes):
    """Two all-gathers and a reduce-scatter in flight at once (as batch streams issue them), by the
    paired exchange and by gloo's own all-gather / all-to-all, against references built here."""
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(7)                    # same on every rank
    b, s, h = 3, sum(sizes), 4
    full = [torch.randn(b, s, h, generator=g) for _ in range(2)]
    summands = [torch.randn(b, s, h, generator=g) for _ in range(2)]
    out = {}
    for enabled in (True, False):
        pair_exchange.enabled, pair_exchange.over_loopback = enabled, True      # the pool meets on loopback
        try:
            started = [collectives.start_all_gather_sequence(_shard(f, sizes, rank).contiguous(), sizes, dist.group.WORLD)
                       for f in full]
            started.append(collectives.start_reduce_scatter_sequence(summands[rank], sizes, rank, dist.group.WORLD))
            out[enabled] = [p.wait() for p in started]
        finally:
            pair_exchange.enabled, pair_exchange.over_loopback = True, False
    want = [*full, _shard(summands[0] + summands[1], sizes, rank)]
    return ([torch.equal(a, w) for a, w in zip(out[True], want)],
            [torch.equal(a, w) for a, w in zip(out[False], want)])


def test_two_rank_gather_and_scatter_by_paired_exchange_match_gloos_bit_for_bit(dist_pool):
    """World 2 on gloo: the all-gather and the reduce-scatter go through pair_exchange (receive
    posted before send); with uneven shares and three in flight at once, they return the same
    bits as gloo's own all-gather and the all-to-all reduce-scatter, and the references'."""
    for rank, (exchanged, gloos) in enumerate(dist_pool(2).run(exchanged_and_gloos_on_rank, (7, 3))):
        assert exchanged == [True, True, True], f"rank {rank}: paired exchange {exchanged}"
        assert gloos == [True, True, True], f"rank {rank}: gloo's own {gloos}"


def exchange_chosen_on_rank():
    """Whether the world group's collectives go by the paired exchange, as the pool met
    (tcp://127.0.0.1) and with the exchange asked for over loopback too."""
    chosen = [pair_exchange.met_on_loopback(), pair_exchange.applies(dist.group.WORLD)]
    pair_exchange.over_loopback = True
    try:
        return chosen + [pair_exchange.applies(dist.group.WORLD)]
    finally:
        pair_exchange.over_loopback = False


def test_two_ranks_met_on_loopback_keep_gloos_collectives(dist_pool):
    """A pair that met at a loopback address takes gloo's own all-gather and all-to-all (faster
    there at every size: bench/pair_exchange_sizes.py); one that met at any other address (the
    edge testbed's, a real host's) exchanges, receive first."""
    assert dist_pool(2).run(exchange_chosen_on_rank) == [[True, False, True]] * 2
    assert [pair_exchange.is_loopback(h) for h in ("127.0.0.1", "127.0.1.1", "localhost", "::1")] == [True] * 4
    assert [pair_exchange.is_loopback(h) for h in ("10.171.48.1", "192.168.1.5", "fe80::1")] == [False] * 3
