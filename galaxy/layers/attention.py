"""The attention core every family's ATT shares: heads in, context out, dropout on the plan's stream;
and SP attention, which attends while the K/V all-gather travels."""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F

from galaxy.layers.attention_blocks import attend_in_blocks, split_attention_available


def split_heads(t, head_dim: int):
    """[b, s, heads*d] -> [b, s, heads, d] (a view)."""
    return t.unflatten(-1, (-1, head_dim))


# The layer context's flag that its mask is the plain causal one, key j visible to query i if
# j <= i over the whole sequence (no padding): attention may then let the kernel apply it.
CAUSAL = "causal"


def attention(q, k, v, mask, *, dropout_p: float, rng_scope=nullcontext, scale=None, enable_gqa: bool = False,
              causal: bool = False):
    """Scaled dot-product attention of q [b, s, heads, d] over k, v [b, S, kv_heads, d] ->
    context [b, s, heads*d]. mask: bool, True = attend, or additive (float: a position bias with
    the masked scores at a very negative value), broadcastable to [b, heads, s, S], or None.
    causal: the mask is the plain causal one over s == S positions (CAUSAL); the kernel applies it
    (is_causal) and the mask is not read. dropout_p > 0 draws inside rng_scope (TP/SP: the rank's
    own dropout stream)."""
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"causal attention takes queries at the keys' positions, got {q.shape[1]} queries "
                         f"over {k.shape[1]} keys")
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))                   # [b, heads, s|S, d]
    if causal:
        mask = None
    elif mask is not None and mask.is_floating_point():
        mask = mask.to(q.dtype)                                          # autocast: as the scores
    with rng_scope() if dropout_p > 0 else nullcontext():
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale,
                                             enable_gqa=enable_gqa, is_causal=causal)
    return ctx.transpose(1, 2).flatten(2)


def attention_while_gathering(q_fn, k, v, gather, mask, *, dropout_p: float, rng_scope=nullcontext, scale=None,
                              enable_gqa: bool = False, blocks: bool = False):
    """SP attention: this rank's queries over every rank's keys, the K/V all-gather travelling
    while the queries are projected and, with `blocks` where the kernel allows (attention_blocks),
    while the rank attends to its own keys; the other ranks' blocks follow once the gather is done.
    Without, one attention over the gathered keys after the gather.

    k, v: this rank's [b, s, kv_heads, d]; q_fn() -> q [b, s, heads, d]; gather: starts the K/V
    all-gather (`start(x)` -> a function returning [b, S, ...]) and says where this rank's tokens
    lie in its result (`own(s)` -> slice); mask as `attention` takes it, over all S keys.
    Returns context [b, s, heads*d]."""
    kv_heads = k.shape[2]
    pending = gather.start(torch.cat((k, v), dim=2).flatten(2))          # one collective for both
    q = q_fn()
    additive = mask is not None and mask.is_floating_point()         # the blocks take bool masks
    if not (blocks and split_attention_available(q, dropout_p)) or additive:
        k_all, v_all = pending().unflatten(-1, (2 * kv_heads, -1)).chunk(2, dim=2)   # [b, S, kv_heads, d]
        return attention(q, k_all, v_all, mask, dropout_p=dropout_p, rng_scope=rng_scope, scale=scale,
                         enable_gqa=enable_gqa)
    own = gather.own(k.shape[1])
    # Rows that see no key at all (left padding of a causal batch) come out as zeros, as from
    # scaled_dot_product_attention, and pass no gradient back.
    sees = None if mask is None else mask.any(-1).transpose(1, 2)      # [b, s|1, 1]: the row sees a key
    if sees is not None and sees.all():
        sees = None

    def in_blocks():
        yield k, v, _columns(mask, own.start, own.stop)
        kv_all = pending().unflatten(-1, (2 * kv_heads, -1))             # [b, S, 2*kv_heads, d]
        # Every rank attends to every other block (masked columns included), so the gather's
        # result is in every rank's graph and every rank issues its backward reduce-scatter.
        for start, stop in ((0, own.start), (own.stop, kv_all.shape[1])):
            if stop > start:
                k_i, v_i = kv_all[:, start:stop].chunk(2, dim=2)
                yield k_i, v_i, _columns(mask, start, stop)

    ctx = attend_in_blocks(q, in_blocks(), scale)                           # [b, s, heads*d]
    return ctx if sees is None else ctx * sees.to(ctx.dtype)


def _columns(mask, start: int, stop: int):
    return None if mask is None else mask[..., start:stop]
