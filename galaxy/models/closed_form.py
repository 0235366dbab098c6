"""Closed forms: what the counter should measure, from the model's shape and the plan alone.

FLOPs are forward matrix products for one batch (2 per multiply-add); the backward is twice that
(dX and dW of every projection, dQ dK dV dP of attention). Communication is per rank per
training step, in the ring convention of galaxy.profiler.comm (ring_bytes, below).

Each family's spec (galaxy.models.registry) points at its two forms here, taking the Hugging
Face config: matmul_flops(cfg, batch, seq, num_labels) and plan_comm_bytes(plan, cfg, batch,
seq_shares). The keyword forms below them take plain numbers (the tests call those).
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
                       intermediate: int, vocab: int, head_dim: int | None = None,
                       mlp_matrices: int = 3) -> dict[str, int]:
    """Llama causal LM (grouped-query attention, SwiGLU, LM head on every position).

    Attention is dense: causal masking does not reduce the count (the report says so).
    mlp_matrices: the MLP's [H, I] products, 3 for SwiGLU (gate, up, down), 2 for GPT-2's.
    """
    d = head_dim or hidden // heads
    bs = batch * seq
    per_layer = {
        "q": 2 * bs * hidden * heads * d,
        "kv": 2 * 2 * bs * hidden * kv_heads * d,
        "attention": 2 * 2 * batch * heads * seq * seq * d,   # query heads: K/V are shared, not fewer products
        "o": 2 * bs * heads * d * hidden,
        "mlp": mlp_matrices * 2 * bs * hidden * intermediate,  # gate, up, down (or up, down)
    }
    parts = {k: layers * v for k, v in per_layer.items()}
    parts["lm_head"] = 2 * bs * hidden * vocab
    parts["total"] = sum(parts.values())
    return parts


def gpt2_matmul_flops(*, batch: int, seq: int, hidden: int, layers: int, heads: int, intermediate: int,
                      vocab: int) -> dict[str, int]:
    """GPT-2 causal LM: Llama's count with plain multi-head attention (c_attn's Q third is "q",
    its K and V thirds "kv", c_proj "o") and a two-matrix MLP (c_fc, c_proj)."""
    return llama_matmul_flops(batch=batch, seq=seq, hidden=hidden, layers=layers, heads=heads, kv_heads=heads,
                              intermediate=intermediate, vocab=vocab, mlp_matrices=2)


def bert_sum_param_units(plan, *, hidden: int, layers: int, intermediate: int, group_size: int) -> list[int]:
    """Elements of BERT's gradients summed over the group, per layer (GradientSync's units, in
    backward order; galaxy.distributed.buckets groups them into all-reduces).

    Per layer: CON SP: two LayerNorms (2 x 2H) and the two deferred output biases (2H);
    ATT SP: Q, K, V weights and biases, the output weight; MLP SP: up weight and bias, down weight.
    """
    if group_size == 1:
        return []
    h, i = hidden, intermediate
    per_layer = (6 * h if plan.con == "SP" else 0) + (4 * h * h + 3 * h if plan.att == "SP" else 0) \
        + (2 * h * i + i if plan.mlp == "SP" else 0)
    return [per_layer] * layers if per_layer else []


def bert_sum_param_numel(plan, *, hidden: int, layers: int, intermediate: int, group_size: int) -> int:
    """Elements of BERT's gradients summed over the group (all of GradientSync's buckets)."""
    return sum(bert_sum_param_units(plan, hidden=hidden, layers=layers, intermediate=intermediate,
                                    group_size=group_size))


def grad_sync_all_reduces(sum_param_units, element_size: int = 4) -> list[int]:
    """Elements of each all-reduce GradientSync issues: its units grouped into buckets of about
    25 MiB (galaxy.distributed.buckets.BUCKET_CAP_BYTES), as the sync groups them."""
    return bucket_numels(list(sum_param_units), max(1, BUCKET_CAP_BYTES // element_size))


def plan_comm_bytes(plan, *, seq_shares, batch: int, hidden: int, layers: int, kv_features: int,
                    exit_tokens: int | None, sum_param_numel: int = 0, head_all_reduces: tuple[int, ...] = (),
                    sum_param_units=(), comm_chunks: int = 1, element_size: int = 4) -> dict:
    """Collectives one rank issues in one training step under `plan`: {kind: {calls, sent, received}}.

    seq_shares: tokens per rank (padded to the largest in gathers and scatters); kv_features: the
    width SP attention gathers (2 x K/V heads x head dim); exit_tokens: tokens per rank gathered
    after the last layer when CON is SP (BERT: 1, the [CLS] candidate), None when the head runs on
    the CON layout; head_all_reduces: elements of each all-reduce the head issues when CON is SP
    (Llama: the LM head weight's gradient and the loss); sum_param_units: elements of the summed
    ("sum" rule) gradients per GradientSync unit, in backward order (a layer, or the parameters
    outside the layers), one all-reduce per bucket of units (grad_sync_all_reduces);
    sum_param_numel: the same as one unit. comm_chunks: a TP ATT's and a TP MLP's transitions travel
    in that many chunks of the sequence (galaxy.layers.block; at most the shortest share under CON
    SP, the sequence under CON None), each chunk's collective padded to its own longest part.
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
        if tp and comm_chunks > 1:
            if con_s:       # chunk j: every rank's j-th part of its share, padded to the longest
                c = min(comm_chunks, min(seq_shares))
                parts = [chunk_sizes(s, c) for s in seq_shares]
                for j in range(c):
                    numel = batch * max(p[j] for p in parts) * hidden
                    for kind in ("all_gather", "reduce_scatter"):   # in and out, fwd and bwd
                        add(kind, numel, 2 * layers)
            else:           # chunk j of the replicated sequence: all-reduce in bwd, out fwd
                for s_j in chunk_sizes(seq, min(comm_chunks, seq)):
                    add("all_reduce", batch * s_j * hidden, 2 * layers)
            continue
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
        for numel in head_all_reduces:
            add("all_reduce", numel)
    units = list(sum_param_units) + ([sum_param_numel] if sum_param_numel else [])
    for numel in grad_sync_all_reduces(units, element_size):
        add("all_reduce", numel)
    return out


def bert_plan_comm_bytes(plan, *, seq_shares, batch: int, hidden: int, layers: int, intermediate: int,
                         comm_chunks: int = 1, element_size: int = 4) -> dict:
    n = len(seq_shares)
    return plan_comm_bytes(plan, seq_shares=seq_shares, batch=batch, hidden=hidden, layers=layers,
                           kv_features=2 * hidden, exit_tokens=1,
                           sum_param_units=bert_sum_param_units(plan, hidden=hidden, layers=layers,
                                                                intermediate=intermediate, group_size=n),
                           comm_chunks=comm_chunks, element_size=element_size)


def llama_sum_param_units(plan, *, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int,
                          intermediate: int, attention_bias: bool = False, mlp_bias: bool = False,
                          qkv_bias: bool | None = None, group_size: int) -> list[int]:
    """Elements of Llama's gradients summed over the group, per GradientSync unit in backward
    order: each layer (last first), then `first_norm` (before the layers).

    attention_bias: q/k/v and o_proj have biases (Llama's key); qkv_bias: q/k/v have biases
    (None: as attention_bias; Qwen2: True with attention_bias False, no o_proj bias).
    CON SP: the RMSNorm weights, [H] each: the first layer's input norm before the first block
    (`first_norm`) plus CON1's and CON2's per layer (CON2 of the last layer holds the final norm),
    (2L + 1) x H; and the deferred output biases, H per layer for each of o_proj / down_proj
    that has one (attention_bias / mlp_bias).
    ATT SP: q_proj [heads*d, H], k_proj and v_proj [kv_heads*d, H], o_proj [H, heads*d];
    with qkv_bias, q/k/v biases (heads*d + 2 kv_heads*d; o_proj's is deferred, above).
    MLP SP: gate_proj and up_proj [I, H], down_proj [H, I]; with mlp_bias, gate and up biases (2I).
    The LM head and the embeddings are not summed here (see llama_plan_comm_bytes).
    """
    if group_size == 1:
        return []
    qkv_bias = attention_bias if qkv_bias is None else qkv_bias
    h, i, q, kv = hidden, intermediate, heads * head_dim, kv_heads * head_dim
    per_layer, first = 0, 0
    if plan.con == "SP":
        per_layer += 2 * h + h * (int(attention_bias) + int(mlp_bias))
        first = h
    if plan.att == "SP":
        per_layer += 2 * q * h + 2 * kv * h + (q + 2 * kv if qkv_bias else 0)
    if plan.mlp == "SP":
        per_layer += 3 * h * i + (2 * i if mlp_bias else 0)
    return [u for u in [per_layer] * layers + [first] if u]


def llama_sum_param_numel(plan, **shape) -> int:
    """Elements of Llama's gradients summed over the group (all of GradientSync's buckets)."""
    return sum(llama_sum_param_units(plan, **shape))


def llama_plan_comm_bytes(plan, *, seq_shares, batch: int, hidden: int, layers: int, heads: int, kv_heads: int,
                          intermediate: int, vocab: int, head_dim: int | None = None,
                          attention_bias: bool = False, mlp_bias: bool = False, qkv_bias: bool | None = None,
                          comm_chunks: int = 1, element_size: int = 4) -> dict:
    """Llama causal LM: collectives one rank issues in one training step (forward, backward, sync).

    N ranks, shares s_i, s = max s_i, b x S tokens, hidden H, d = head_dim (H / heads by default).
    Every layer is the same four-transition block as BERT's (galaxy.layers.block): each sub-block
    reads the CON's normalised input x [b, S|s_i, H] and hands its output back; the residual
    stream, the carry's other half, never leaves the CON layout, so it adds no collective. Per
    layer and per TP/SP sub-block (plan_comm_bytes, forward | backward; shards [b, s, H]):
      CON SP,   TP:  S -> R gather | reduce-scatter in, P -> S reduce-scatter | gather out
      CON None, TP:  R -> R copy | all-reduce [b, S, H] in, P -> R all-reduce | identity out
      CON None, SP:  R -> S split | gather in, S -> R gather | split out
      CON SP,   SP:  nothing
    SP attention gathers K and V, rotated, as one tensor [b, s, 2 kv_heads d] (grouped-query:
    kv_heads, not heads), then reduce-scatters its gradient: kv_features = 2 kv_heads d.
    Entry (CON SP): the embeddings run replicated and are split, R -> S (free), whose backward
    all-gathers the gradient [b, s, H]; first_norm runs after the split, on the shards.
    Head (CON SP): each rank scores its own tokens with the replicated LM head, so nothing is
    gathered at the exit (exit_tokens None); instead the head weight's gradient [vocab, H] is
    all-reduced in backward (tied or not: the head's contribution is what is summed, same size),
    and the loss, a scalar of this rank's tokens, is all-reduced in forward. Under CON None the
    head runs on R: no collective.
    Gradient sync: one all-reduce per bucket of the "sum" parameters (llama_sum_param_units; the
    bias flags are its own).
    """
    d = head_dim or hidden // heads
    n = len(seq_shares)
    return plan_comm_bytes(plan, seq_shares=seq_shares, batch=batch, hidden=hidden, layers=layers,
                           kv_features=2 * kv_heads * d, exit_tokens=None,
                           head_all_reduces=(vocab * hidden, 1),
                           sum_param_units=llama_sum_param_units(
                               plan, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, head_dim=d,
                               intermediate=intermediate, attention_bias=attention_bias, mlp_bias=mlp_bias,
                               qkv_bias=qkv_bias, group_size=n),
                           comm_chunks=comm_chunks, element_size=element_size)


def gpt2_sum_param_units(plan, *, hidden: int, layers: int, intermediate: int, group_size: int) -> list[int]:
    """Elements of GPT-2's gradients summed over the group, per GradientSync unit in backward order.

    Per layer the sub-blocks hold what BERT's do (bert_sum_param_units): CON SP: two LayerNorms
    (ln_2 in CON1, the next ln_1 or ln_f in CON2, weight and bias: 2 x 2H) and the two deferred
    c_proj biases (2H); ATT SP: c_attn [3H, H] and its bias 3H, c_proj [H, H]; MLP SP: c_fc [I, H]
    and its bias I, c_proj [H, I]. Then, under CON SP, the first layer's ln_1 before the first
    block (`first_norm`, 2H), the last unit backward finishes. The embeddings and the tied LM head
    are not summed here.
    """
    units = bert_sum_param_units(plan, hidden=hidden, layers=layers, intermediate=intermediate, group_size=group_size)
    return units + ([2 * hidden] if plan.con == "SP" and group_size > 1 else [])


def gpt2_sum_param_numel(plan, **shape) -> int:
    """Elements of GPT-2's gradients summed over the group (all of GradientSync's buckets)."""
    return sum(gpt2_sum_param_units(plan, **shape))


def gpt2_plan_comm_bytes(plan, *, seq_shares, batch: int, hidden: int, layers: int, intermediate: int, vocab: int,
                         comm_chunks: int = 1, element_size: int = 4) -> dict:
    """GPT-2 causal LM: collectives one rank issues in one training step (forward, backward, sync).

    The same transitions as Llama's (llama_plan_comm_bytes: the residual stream never leaves the
    CON layout; the head runs on it, so under CON SP the LM head weight's gradient [vocab, H] and
    the loss are all-reduced instead of gathering activations), with plain multi-head attention:
    SP attention gathers K and V as one tensor [b, s, 2H] (kv_features = 2H). Gradient sync: one
    all-reduce per bucket of gpt2_sum_param_units.
    """
    n = len(seq_shares)
    return plan_comm_bytes(plan, seq_shares=seq_shares, batch=batch, hidden=hidden, layers=layers,
                           kv_features=2 * hidden, exit_tokens=None, head_all_reduces=(vocab * hidden, 1),
                           sum_param_units=gpt2_sum_param_units(plan, hidden=hidden, layers=layers,
                                                                intermediate=intermediate, group_size=n),
                           comm_chunks=comm_chunks, element_size=element_size)


def human_check(measured: int, expected: int) -> str:
    """'exact' or the relative difference, for printing."""
    if measured == expected:
        return "exact"
    return f"{(measured - expected) / max(expected, 1):+.2%}" if expected else "n/a"


# -- the spec entries: the Hugging Face config in, the closed forms above out -----------------

def bert_flops_of(cfg, batch: int, seq: int, num_labels: int) -> dict[str, int]:
    return bert_matmul_flops(batch=batch, seq=seq, hidden=cfg.hidden_size, layers=cfg.num_hidden_layers,
                             intermediate=cfg.intermediate_size, num_labels=num_labels)


def bert_comm_of(plan, cfg, batch: int, seq_shares, comm_chunks: int = 1) -> dict:
    return bert_plan_comm_bytes(plan, seq_shares=seq_shares, batch=batch, hidden=cfg.hidden_size,
                                layers=cfg.num_hidden_layers, intermediate=cfg.intermediate_size,
                                comm_chunks=comm_chunks)


def _llama_shape(cfg) -> dict:
    heads = cfg.num_attention_heads
    return dict(hidden=cfg.hidden_size, layers=cfg.num_hidden_layers, intermediate=cfg.intermediate_size,
                heads=heads, kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
                vocab=cfg.vocab_size, head_dim=getattr(cfg, "head_dim", None))


def llama_flops_of(cfg, batch: int, seq: int, num_labels=None) -> dict[str, int]:
    return llama_matmul_flops(batch=batch, seq=seq, **_llama_shape(cfg))


def llama_comm_of(plan, cfg, batch: int, seq_shares, comm_chunks: int = 1) -> dict:
    return llama_plan_comm_bytes(plan, seq_shares=seq_shares, batch=batch, **_llama_shape(cfg),
                                 attention_bias=bool(getattr(cfg, "attention_bias", False)),
                                 mlp_bias=bool(getattr(cfg, "mlp_bias", False)), comm_chunks=comm_chunks)


def qwen2_comm_of(plan, cfg, batch: int, seq_shares, comm_chunks: int = 1) -> dict:
    """Qwen2 is Llama with q/k/v biases and no o_proj or MLP bias (galaxy.models.qwen2); its
    matmul FLOPs are Llama's (llama_flops_of: a bias adds no matrix product)."""
    return llama_plan_comm_bytes(plan, seq_shares=seq_shares, batch=batch, **_llama_shape(cfg), qkv_bias=True,
                                 comm_chunks=comm_chunks)


def _gpt2_shape(cfg) -> dict:
    from galaxy.models.gpt2 import inner_size
    return dict(hidden=cfg.n_embd, layers=cfg.n_layer, intermediate=inner_size(cfg), vocab=cfg.vocab_size)


def gpt2_flops_of(cfg, batch: int, seq: int, num_labels=None) -> dict[str, int]:
    return gpt2_matmul_flops(batch=batch, seq=seq, heads=cfg.n_head, **_gpt2_shape(cfg))


def gpt2_comm_of(plan, cfg, batch: int, seq_shares, comm_chunks: int = 1) -> dict:
    return gpt2_plan_comm_bytes(plan, seq_shares=seq_shares, batch=batch, **_gpt2_shape(cfg),
                                comm_chunks=comm_chunks)
