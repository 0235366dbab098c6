"""The attention core every family's ATT shares: heads in, context out, dropout on the plan's stream."""
from __future__ import annotations

from contextlib import nullcontext

import torch.nn.functional as F


def split_heads(t, head_dim: int):
    """[b, s, heads*d] -> [b, s, heads, d] (a view)."""
    return t.unflatten(-1, (-1, head_dim))


def attention(q, k, v, mask, *, dropout_p: float, rng_scope=nullcontext, scale=None, enable_gqa: bool = False):
    """Scaled dot-product attention of q [b, s, heads, d] over k, v [b, S, kv_heads, d] ->
    context [b, s, heads*d]. mask: bool, True = attend, broadcastable to [b, heads, s, S], or None.
    dropout_p > 0 draws inside rng_scope (TP/SP: the rank's own dropout stream)."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))                   # [b, heads, s|S, d]
    with rng_scope() if dropout_p > 0 else nullcontext():
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale,
                                             enable_gqa=enable_gqa)
    return ctx.transpose(1, 2).flatten(2)
