"""Closed forms of the encoder-decoders (BART, T5): what the profiler should measure, from the
shape and the plan alone. bart.py and t5.py pass their shapes (EncDecShape) to these.

FLOPs: 2 per multiply-add, forward; the backward is twice that (every input needs a gradient:
the shared table is trained, the memory feeds the encoder). Bytes: per rank and training step, in
the ring convention of galaxy.distributed.comm_bytes.

Notation: b rows, S source tokens, T target tokens, h = d_model, a = heads x head dim (the
attention's inner width: h for BART, num_heads x d_kv for T5), I the MLP width, m its [h, I]
products (2: up and down; 3: T5 v1.1's gated wi_0, wi_1, wo).
"""
from __future__ import annotations

from dataclasses import dataclass

from galaxy.distributed.comm_bytes import (end_collectives, grad_sync_all_reduces, layer_collectives,
                                           sub_block_collectives, tally)


@dataclass(frozen=True)
class EncDecShape:
    hidden: int                 # h
    inner: int                  # a: heads x head dim
    heads: int
    encoder_layers: int
    decoder_layers: int
    intermediate: int           # I
    mlp_matrices: int           # m
    vocab: int
    # elements of the "sum" gradients (galaxy.parallel.grad_sync), per sub-block of one layer
    # when its method shards tokens: {"con_encoder", "con_decoder", "att", "mlp"} and, before
    # the layers, {"first_con" (CON SP), "first_att" (ATT SP)}
    sums: dict


def encdec_matmul_flops(shape: EncDecShape, *, batch: int, source: int, target: int,
                        num_labels: int | None = None) -> dict[str, int]:
    """Forward matrix FLOPs of one encoder-decoder pass: the encoder over b x S tokens; each
    decoder layer's self-attention over b x T, its cross-attention's Q from the T target tokens
    and K/V projected from the S source tokens (T x S scores per head), the MLPs; then the LM
    head on every target position (tied or not), or (num_labels) the classifier on one token
    per row (dense [h, h], out_proj [labels, h]; its decoder reads the source: T = S)."""
    h, a, i, m = shape.hidden, shape.inner, shape.intermediate, shape.mlp_matrices
    enc, dec = shape.encoder_layers, shape.decoder_layers
    bs, bt = batch * source, batch * target
    parts = {
        "encoder_qkv": enc * 3 * 2 * bs * h * a,
        "encoder_attention": enc * 2 * 2 * batch * source * source * a,   # Q K^T and P V over all heads
        "encoder_out": enc * 2 * bs * a * h,
        "encoder_mlp": enc * m * 2 * bs * h * i,
        "decoder_qkv": dec * 3 * 2 * bt * h * a,
        "decoder_attention": dec * 2 * 2 * batch * target * target * a,  # dense, though causal
        "decoder_out": dec * 2 * bt * a * h,
        "cross_q": dec * 2 * bt * h * a,
        "cross_kv": dec * 2 * 2 * bs * h * a,                             # from the memory
        "cross_attention": dec * 2 * 2 * batch * target * source * a,
        "cross_out": dec * 2 * bt * a * h,
        "decoder_mlp": dec * m * 2 * bt * h * i,
    }
    if num_labels is None:
        parts["lm_head"] = 2 * bt * h * shape.vocab
    else:
        parts["classifier"] = 2 * batch * h * h + 2 * batch * h * num_labels
    parts["total"] = sum(parts.values())
    return parts


def encdec_sum_param_units(plan, shape: EncDecShape, group_size: int) -> list[int]:
    """Elements of the summed gradients per GradientSync unit, in backward order: the decoder's
    layers (last first), the encoder's, then the modules before the layers (T5: the stacks'
    first norms under CON SP, the position bias tables under ATT SP). A decoder layer sums its
    XATT's parameters as an ATT's under XATT SP."""
    if group_size == 1:
        return []
    s = shape.sums
    sp = {kind: plan.method(kind) == "SP" for kind in ("att", "xatt", "mlp", "con")}
    shared = s["att"] * sp["att"] + s["mlp"] * sp["mlp"]
    decoder = shared + s["con_decoder"] * sp["con"] + s["att"] * sp["xatt"]
    encoder = shared + s["con_encoder"] * sp["con"]
    before = s.get("first_con", 0) * sp["con"] + s.get("first_att", 0) * sp["att"]
    units = [decoder] * shape.decoder_layers + [encoder] * shape.encoder_layers + [before]
    return [u for u in units if u]


def encdec_plan_comm_bytes(plan, shape: EncDecShape, *, source_shares, target_shares, batch: int,
                           classifier: bool = False, comm_chunks: int = 1, element_size: int = 4) -> dict:
    """Collectives one rank issues in one training step of the seq2seq LM, or of the classifier
    (forward, backward, gradient sync): {kind: {calls, sent, received}}.

    Encoder layers: every family's block on the source shares (galaxy.distributed.comm_bytes;
    SP ATT gathers K and V, 2a wide). Decoder layers: the same on the target shares, plus XATT,
    a TP or SP sub-block of its own method without any K/V gather (its keys come from the memory,
    whole on every rank); XATT's transitions do not travel in chunks.
    Memory (once per step): CON SP, gathered from the source shares for a sharded consumer
    (all-gather | reduce-scatter [b, S_max, h]); CON None, copied (identity | all-reduce [b, S, h]).
    Ends under CON SP: each stack's entry split (its backward all-gathers the embeddings'
    gradient, [b, max share, h]), and the LM head on the target shares: the head weight's
    gradient [vocab, h] and the loss all-reduced; the classifier instead sums each row's pooled
    token over the group, one [b, h] all-reduce (its parameters are replicated, its loss whole).
    Gradient sync: encdec_sum_param_units.
    """
    n = len(source_shares)
    if n == 1:
        return {}
    h, con_s = shape.hidden, plan.con == "SP"
    calls = layer_collectives(plan, source_shares, batch, h, shape.encoder_layers, 2 * shape.inner, comm_chunks)
    calls += layer_collectives(plan, target_shares, batch, h, shape.decoder_layers, 2 * shape.inner, comm_chunks)
    calls += sub_block_collectives(plan.method("xatt"), con_s, target_shares, batch, h, shape.decoder_layers)
    memory = batch * max(source_shares) * h
    if con_s:
        calls += [("all_gather", memory, 1), ("reduce_scatter", memory, 1)]
    else:
        calls.append(("all_reduce", batch * sum(source_shares) * h, 1))
    calls += end_collectives(plan, source_shares, batch, h, exit_tokens=None)
    head = (batch * h,) if classifier else (shape.vocab * h, 1)
    calls += end_collectives(plan, target_shares, batch, h, exit_tokens=None, head_all_reduces=head)
    units = encdec_sum_param_units(plan, shape, n)
    calls += [("all_reduce", numel, 1) for numel in grad_sync_all_reduces(units, element_size)]
    return tally(calls, n, element_size)



def flops_entry(shape_of):
    """A FamilySpec.matmul_flops from shape_of(cfg) -> EncDecShape: (cfg, batch, seq, num_labels,
    target) -> the parts; target: the decoder's tokens (default seq; a classifier's are seq)."""
    def flops_of(cfg, batch: int, seq: int, num_labels: int | None = None, target: int | None = None):
        target = seq if num_labels is not None or target is None else target
        return encdec_matmul_flops(shape_of(cfg), batch=batch, source=seq, target=target, num_labels=num_labels)
    return flops_of


def comm_entry(shape_of):
    """A FamilySpec.plan_comm_bytes: the resolved plan's decoder_tokens are the target shares;
    num_labels: the classifier's (None: the LM's)."""
    def comm_of(plan, cfg, batch: int, seq_shares, comm_chunks: int = 1, num_labels: int | None = None) -> dict:
        return encdec_plan_comm_bytes(plan, shape_of(cfg), source_shares=seq_shares,
                                      target_shares=plan.decoder_tokens, batch=batch,
                                      classifier=num_labels is not None, comm_chunks=comm_chunks)
    return comm_of
