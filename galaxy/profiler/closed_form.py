"""Closed forms: what the counter should measure, from the model's shape and the plan alone.

FLOPs are forward matrix products for one batch (2 per multiply-add); the backward is twice that
(dX and dW of every projection, dQ dK dV dP of attention). Communication is per rank per
training step, in the ring convention of galaxy.profiler.comm.
"""
from __future__ import annotations


from galaxy.profiler.comm import ring_bytes


def bert_matmul_flops(*, batch: int, seq: int, hidden: int, layers: int, intermediate: int,
                      num_labels: int) -> dict[str, int]:
    """BERT for sequence classification (encoder, pooler on [CLS], classifier)."""
    bs = batch * seq
    per_layer = {
        "qkv": 3 * 2 * bs * hidden * hidden,
        "attention": 2 * 2 * batch * seq * seq * hidden,      # Q K^T and P V over all heads
        "out": 2 * bs * hidden * hidden,
        "mlp": 2 * 2 * bs * hidden * intermediate,
    }
    parts = {k: layers * v for k, v in per_layer.items()}
    parts["pooler"] = 2 * batch * hidden * hidden
    parts["classifier"] = 2 * batch * hidden * num_labels
    parts["total"] = sum(parts.values())
    return parts


def llama_matmul_flops(*, batch: int, seq: int, hidden: int, layers: int, heads: int, kv_heads: int,
                       intermediate: int, vocab: int, head_dim: int | None = None) -> dict[str, int]:
    """Llama causal LM (grouped-query attention, SwiGLU, LM head on every position).

    Attention is dense: causal masking does not reduce the count (the report says so).
    """
    d = head_dim or hidden // heads
    bs = batch * seq
    per_layer = {
        "q": 2 * bs * hidden * heads * d,
        "kv": 2 * 2 * bs * hidden * kv_heads * d,
        "attention": 2 * 2 * batch * heads * seq * seq * d,   # query heads: K/V are shared, not fewer products
        "o": 2 * bs * heads * d * hidden,
        "mlp": 3 * 2 * bs * hidden * intermediate,            # gate, up, down
    }
    parts = {k: layers * v for k, v in per_layer.items()}
    parts["lm_head"] = 2 * bs * hidden * vocab
    parts["total"] = sum(parts.values())
    return parts


def bert_sum_param_numel(plan, *, hidden: int, layers: int, intermediate: int, group_size: int) -> int:
    """Elements of BERT's gradients summed over the group (GradientSync's one all-reduce).

    Per layer: CON SP: two LayerNorms (2 x 2H) and the two deferred output biases (2H);
    ATT SP: Q, K, V weights and biases, the output weight; MLP SP: up weight and bias, down weight.
    """
    if group_size == 1:
        return 0
    h, i = hidden, intermediate
    per_layer = (6 * h if plan.con == "SP" else 0) + (4 * h * h + 3 * h if plan.att == "SP" else 0) \
        + (2 * h * i + i if plan.mlp == "SP" else 0)
    return layers * per_layer


def plan_comm_bytes(plan, *, seq_shares, batch: int, hidden: int, layers: int, kv_features: int,
                    exit_tokens: int | None, sum_param_numel: int, element_size: int = 4) -> dict:
    """Collectives one rank issues in one training step under `plan`: {kind: {calls, sent, received}}.

    seq_shares: tokens per rank (padded to the largest in gathers and scatters); kv_features: the
    width SP attention gathers (2 x K/V heads x head dim); exit_tokens: tokens per rank gathered
    after the last layer when CON is SP (BERT: 1, the [CLS] candidate), None when the head runs on
    the CON layout; sum_param_numel: elements of GradientSync's all-reduce.
    """
    n = len(seq_shares)
    out: dict[str, dict] = {}
    if n == 1:
        return out
    seq, longest = sum(seq_shares), max(seq_shares)
    shard, full = batch * longest * hidden, batch * seq * hidden

    def add(kind, numel, times=1):
        c = out.setdefault(kind, {"calls": 0, "sent": 0, "received": 0})
        b = ring_bytes(kind, numel, element_size, n)
        c["calls"] += times
        c["sent"] += times * b
        c["received"] += times * b

    con_s = plan.con == "SP"
    for method in (plan.att, plan.mlp):
        tp = method == "TP"
        # CON -> sub-block (forward | backward)
        if con_s and tp:
            add("all_gather", shard, layers)        # S -> R for a TP consumer | reduce-scatter
            add("reduce_scatter", shard, layers)
        elif not con_s and tp:
            add("all_reduce", full, layers)         # R -> R copy | all-reduce of the input gradient
        elif not con_s and not tp:
            add("all_gather", shard, layers)        # R -> S split | all-gather
        # sub-block -> CON
        if tp and con_s:
            add("reduce_scatter", shard, layers)    # P -> S | all-gather
            add("all_gather", shard, layers)
        elif tp:
            add("all_reduce", full, layers)         # P -> R | identity
        elif not con_s:
            add("all_gather", shard, layers)        # S -> R, replicated consumer | split
    if plan.att == "SP":                            # K and V, one collective: gather | reduce-scatter
        add("all_gather", batch * longest * kv_features, layers)
        add("reduce_scatter", batch * longest * kv_features, layers)
    if con_s:
        add("all_gather", shard)                    # enter: R -> S split | all-gather
        if exit_tokens is not None:
            add("all_gather", batch * exit_tokens * hidden)   # exit: S -> R | split
    if sum_param_numel:
        add("all_reduce", sum_param_numel)
    return out


def bert_plan_comm_bytes(plan, *, seq_shares, batch: int, hidden: int, layers: int, intermediate: int,
                         element_size: int = 4) -> dict:
    n = len(seq_shares)
    return plan_comm_bytes(plan, seq_shares=seq_shares, batch=batch, hidden=hidden, layers=layers,
                           kv_features=2 * hidden, exit_tokens=1,
                           sum_param_numel=bert_sum_param_numel(plan, hidden=hidden, layers=layers,
                                                                intermediate=intermediate, group_size=n),
                           element_size=element_size)


def human_check(measured: int, expected: int) -> str:
    """'exact' or the relative difference, for printing."""
    if measured == expected:
        return "exact"
    return f"{(measured - expected) / max(expected, 1):+.2%}" if expected else "n/a"
