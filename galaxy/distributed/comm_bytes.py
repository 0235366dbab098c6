"""What a plan's collectives move, in closed form: the byte counts the profiler measures
(galaxy.profiler.comm) and the planner times (galaxy.planner.cost), from shapes alone.

Bytes are per rank, in the ring convention: a collective moving `numel` elements over n ranks
sends (= receives) (n - 1) x numel (all-gather, reduce-scatter; numel = the gathered whole) or
2 (n - 1) x ceil(numel / n) (all-reduce) elements per rank.

Every family's layers are the same four-transition block (galaxy.layers.block), so the
per-layer transitions (galaxy.distributed.transitions) and the SP K/V gather are counted here
once; a family's closed form (beside its model, e.g. galaxy.models.bert) adds what is its own:
the K/V width, what its head gathers or all-reduces, and the elements of its "sum" gradients.
"""
from __future__ import annotations

from galaxy.distributed.buckets import BUCKET_CAP_BYTES, bucket_numels
from galaxy.distributed.overlap import chunk_sizes


def ring_bytes(kind: str, numel: int, element_size: int, group_size: int) -> int:
    """Bytes one rank sends (= receives) for a collective moving `numel` elements (see above)."""
    n = group_size
    if n <= 1:
        return 0
    if kind in ("all_gather", "reduce_scatter"):
        return (n - 1) * numel * element_size
    if kind == "all_reduce":
        return 2 * (n - 1) * -(-numel // n) * element_size
    raise ValueError(f"unknown collective kind {kind!r}")


def grad_sync_all_reduces(sum_param_units, element_size: int = 4) -> list[int]:
    """Elements of each all-reduce GradientSync issues: its units grouped into buckets of about
    25 MiB (galaxy.distributed.buckets.BUCKET_CAP_BYTES), as the sync groups them."""
    return bucket_numels(list(sum_param_units), max(1, BUCKET_CAP_BYTES // element_size))


def sum_param_units(plan, *, layers: int, group_size: int, att: int, mlp: int, con: int, first: int = 0) -> list[int]:
    """Elements of the gradients summed over the group ("sum" rule), per GradientSync unit in
    backward order: each layer (last first), then the parameters before the first block.

    Per layer, the elements of the parameters each sub-block sums when its method shards tokens:
    att (ATT SP: all of ATT's but the deferred bias), mlp (MLP SP: likewise), con (CON SP: both
    CONs' norms and the two deferred biases); first: CON SP, the norm before the first block.
    """
    if group_size == 1:
        return []
    per_layer = ((con if plan.con == "SP" else 0) + (att if plan.att == "SP" else 0)
                 + (mlp if plan.mlp == "SP" else 0))
    first = first if plan.con == "SP" else 0
    return [u for u in [per_layer] * layers + [first] if u]


def plan_comm_bytes(plan, *, seq_shares, batch: int, hidden: int, layers: int, kv_features: int,
                    exit_tokens: int | None, sum_param_numel: int = 0, head_all_reduces: tuple[int, ...] = (),
                    sum_param_units=(), comm_chunks: int = 1, element_size: int = 4) -> dict:
    """Collectives one rank issues in one training step under `plan`: {kind: {calls, sent, received}}.

    seq_shares: tokens per rank (padded to the largest in gathers and scatters); kv_features: the
    width SP attention gathers (2 x K/V heads x head dim); exit_tokens: tokens per rank gathered
    after the last layer when CON is SP (BERT: 1, the [CLS] candidate), None when the head runs on
    the CON layout; head_all_reduces: elements of each all-reduce the head issues when CON is SP
    (a causal LM: the LM head weight's gradient and the loss); sum_param_units: elements of the
    summed ("sum" rule) gradients per GradientSync unit, in backward order (sum_param_units), one
    all-reduce per bucket of units (grad_sync_all_reduces); sum_param_numel: the same as one unit.
    comm_chunks: a TP ATT's and a TP MLP's transitions travel in that many chunks of the sequence
    (galaxy.layers.block; at most the shortest share under CON SP, the sequence under CON None),
    each chunk's collective padded to its own longest part.
    """
    n = len(seq_shares)
    if n == 1:
        return {}
    calls = layer_collectives(plan, seq_shares, batch, hidden, layers, kv_features, comm_chunks)
    calls += end_collectives(plan, seq_shares, batch, hidden, exit_tokens, head_all_reduces)
    units = list(sum_param_units) + ([sum_param_numel] if sum_param_numel else [])
    calls += [("all_reduce", numel, 1) for numel in grad_sync_all_reduces(units, element_size)]
    return tally(calls, n, element_size)


def tally(calls, group_size: int, element_size: int = 4) -> dict:
    """(kind, elements, times) per collective -> {kind: {calls, sent, received}} for one rank."""
    n = group_size
    out: dict[str, dict] = {}
    for kind, numel, times in calls:
        c = out.setdefault(kind, {"calls": 0, "sent": 0, "received": 0})
        b = ring_bytes(kind, numel, element_size, n)
        c["calls"] += times
        c["sent"] += times * b
        c["received"] += times * b
    return out


def layer_collectives(plan, seq_shares, batch: int, hidden: int, layers: int, kv_features: int,
                      comm_chunks: int = 1) -> list[tuple[str, int, int]]:
    """(kind, elements, times) of every layer's transitions (forward | backward), for the TP and
    SP sub-blocks of `plan` (docs/design.md section 2), and SP attention's K/V gather."""
    longest = max(seq_shares)
    calls = []
    for method in (plan.att, plan.mlp):
        calls += sub_block_collectives(method, plan.con == "SP", seq_shares, batch, hidden, layers, comm_chunks)
    if plan.att == "SP":          # K and V, one collective: gather | reduce-scatter
        calls += [("all_gather", batch * longest * kv_features, layers),
                  ("reduce_scatter", batch * longest * kv_features, layers)]
    return calls


def sub_block_collectives(method: str, con_s: bool, seq_shares, batch: int, hidden: int, layers: int,
                          comm_chunks: int = 1) -> list[tuple[str, int, int]]:
    """(kind, elements, times) of one sub-block's two transitions per layer (into it, out of it;
    forward | backward), by its method and whether CON is SP; comm_chunks: a TP one's chunks."""
    shard, full = batch * max(seq_shares) * hidden, batch * sum(seq_shares) * hidden
    tp = method == "TP"
    if tp and comm_chunks > 1:
        return _chunked_collectives(con_s, seq_shares, batch, hidden, layers, comm_chunks)
    if con_s and tp:
        # S -> R for a TP consumer | reduce-scatter; P -> S | all-gather
        return [("all_gather", shard, layers), ("reduce_scatter", shard, layers),
                ("reduce_scatter", shard, layers), ("all_gather", shard, layers)]
    if tp:
        return [("all_reduce", full, layers), ("all_reduce", full, layers)]   # R -> R copy, P -> R
    if not con_s:
        return [("all_gather", shard, layers), ("all_gather", shard, layers)]  # R -> S split, S -> R
    return []


def _chunked_collectives(con_s: bool, seq_shares, batch: int, hidden: int, layers: int, comm_chunks: int):
    """A TP sub-block's transitions in chunks (galaxy.distributed.overlap.chunked_tokenwise)."""
    if con_s:       # chunk j: every rank's j-th part of its share, padded to the longest
        c = min(comm_chunks, min(seq_shares))
        parts = [chunk_sizes(s, c) for s in seq_shares]
        return [(kind, batch * max(p[j] for p in parts) * hidden, 2 * layers)
                for j in range(c) for kind in ("all_gather", "reduce_scatter")]     # in and out, fwd and bwd
    seq = sum(seq_shares)         # chunk j of the replicated sequence: all-reduce in bwd, out fwd
    return [("all_reduce", batch * s_j * hidden, 2 * layers) for s_j in chunk_sizes(seq, min(comm_chunks, seq))]


def end_collectives(plan, seq_shares, batch: int, hidden: int, exit_tokens: int | None,
                    head_all_reduces=()) -> list[tuple[str, int, int]]:
    """(kind, elements, times) at the model's ends under CON SP: the entry's split (its backward
    all-gathers), the exit's gather of exit_tokens per rank, the head's all-reduces."""
    if plan.con != "SP":
        return []
    calls = [("all_gather", batch * max(seq_shares) * hidden, 1)]       # enter: R -> S split | all-gather
    if exit_tokens is not None:
        calls.append(("all_gather", batch * exit_tokens * hidden, 1))   # exit: S -> R | split
    return calls + [("all_reduce", numel, 1) for numel in head_all_reduces]
