"""The shared SelfAttention with a KV cache: its prefill and decode forward under every plan.

The engine (galaxy.inference) puts a CacheStep under STEP_KEY in the layer context. The prompt
(prefill) runs as in training, and each rank writes the keys and values it computed to its cache;
a decode step projects one token per row and attends to the cache:

  serial, ATT TP    prefill: the whole prompt's K/V of the rank's heads go to the cache, the prompt
                    attends to itself under its causal mask. A prompt in chunks (prefill_chunks,
                    a pipeline's): each chunk's K/V are appended, and its queries attend
                    to every cached key so far under the mask's rows of the chunk [b, 1, c, T]:
                    the cache the decode reads is the unchunked prefill's (galaxy.inference.
                    chunked_prefill). decode: q, k, v of the new token for the rank's heads; k, v
                    appended; q over every cached key (SDPA, the cache's keep mask). The output
                    is partial over the heads, as in training (P -> R after it).
  ATT SP            prefill: as in training (own queries over every rank's gathered keys); the
                    rank caches only its own tokens' K/V. decode: the new token is replicated on
                    every rank (the decode phase's layout, galaxy.parallel.decode_layout); every
                    rank projects q, k, v for all heads, the step's owner rank (round-robin) stores
                    k, v, and every rank attends q to its own cached keys only, giving a partial
                    output o_r and its log-sum-exp lse_r; one all-gather of [o_r, lse_r]
                    ([b, 1, heads, d + 1], a few KB; over the group's TokenLink where the
                    engine has one, CacheStep.link) and the exact merge
                        lse = logaddexp_r lse_r,   o = sum_r exp(lse_r - lse) o_r
                    give every rank the attention over all keys (flash-decoding's merge across
                    ranks), so no cached key ever travels.

A decoder without prefill (an encoder-decoder's: galaxy.models.seq2seq) starts with an empty cache
(prompt 0) and may add a bias to the scores (KEY_BIAS, T5's relative positions): column t for the
t-th decoded token, so a rank takes the columns of the tokens it caches (all of them serially
and under TP; t = r, r + N, ... under SP, the round-robin owner's).

A cross-attention (XATT, attend_memory) caches the encoder's output once, at the first pass: its
heads of every source token (serial, TP), or under SP all heads of its own source tokens; a
decode step attends to them, under SP by the same partial attention and merge as ATT SP's.
T5's cross-attention adds no position bias; the source's padding is the cache's keep mask.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from galaxy.distributed.collectives import all_gather_sequence
from galaxy.layers.attention import CAUSAL, attention, split_heads
from galaxy.layers.kv_cache import KEY_BIAS, STEP_KEY, KVCache


def start_cache(att, rows: int, prompt: int, new: int, dtype, device) -> KVCache:
    """att's cache: every slot of the prompt and the new tokens (serial, TP), or under SP its own
    prompt tokens (none without prefill: prompt 0) plus its round-robin share of the decoded ones."""
    if att.kv_gather is None:
        slots = prompt + new
    else:
        g = att.kv_gather.group
        if prompt not in (0, sum(g.tokens)):
            raise ValueError(f"an SP attention's prefill must be the {sum(g.tokens)} tokens its shares split "
                             f"(or none), got {prompt}")
        slots = (g.tokens[g.rank] if prompt else 0) + math.ceil(new / g.size)
    return KVCache(rows, att.num_kv_heads, slots, att.head_dim, dtype, device)


def attend(att, x, context: dict):
    """x [b, s, h] (the prompt, or one token per row) -> context [b, s, heads*d], through the cache."""
    step = context[STEP_KEY]
    if att.kv_gather is None:
        return _every_token(att, x, context, step)
    if not step.decoding:
        context = att.own_rows(context)
        queries, k, v = att.own_keys(x, context)                        # k, v [b, s_r, kv_heads, d]
        att.kv_cache.write(k.transpose(1, 2), v.transpose(1, 2), step.keep[:, att.local_rows])
        return att.attend_across_ranks(queries, k, v, context)
    return _decode_across_ranks(att, x, context, step)


def _heads(att, x, context: dict):
    """q [b, s, heads, d], k, v [b, s, kv_heads, d] of x, q and k at their positions."""
    q, k, v = (split_heads(t, att.head_dim) for t in att.project(x))
    return att.at_positions(q, context), att.at_positions(k, context), v


def _every_token(att, x, context: dict, step):
    """Serial or ATT TP: the rank's heads of every token are cached."""
    q, k, v = _heads(att, x, context)
    att.kv_cache.write(k.transpose(1, 2), v.transpose(1, 2), step.keep)
    if not step.decoding:      # the prompt attends to itself, as in training
        first = att.kv_cache.length == k.shape[1]
        if not first:       # a later chunk of it: also to the earlier chunks' keys (the mask's rows hold causality)
            k, v = (t.transpose(1, 2) for t in att.kv_cache.filled()[:2])          # [b, T, kv_heads, d]
        # CAUSAL (no padding) over the keys from the first: the kernel applies the mask itself, as
        # in training (8 layers' cores over 512 tokens: 106 ms against 114 under the mask)
        return attention(q, k, v, context.get("mask"), dropout_p=0.0, scale=att.scale, enable_gqa=att.group > 1,
                         causal=first and bool(context.get(CAUSAL)))
    cache = att.kv_cache
    k, v, keep = cache.filled()                                          # [b, kv_heads, T, d], [b, T]
    mask = decode_mask(keep, context.get(KEY_BIAS), slice(cache.start, cache.length), q.dtype)
    ctx = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask,
                                         scale=att.scale, enable_gqa=att.group > 1)    # [b, heads, 1, d]
    return ctx.transpose(1, 2).flatten(2)


def decode_mask(keep, bias, columns, dtype):
    """A decode step's mask over cached keys, keep [b, T]: bool [b, 1, 1, T], or, with a key bias
    [1 | b, heads, 1, T_all], the bias at these keys' `columns` (an index [T] or a slice) with
    hidden keys at -inf."""
    if bias is None:
        return keep[:, None, None, :]
    return bias[..., columns].to(dtype).masked_fill(~keep[:, None, None, :], float("-inf"))


def _decode_across_ranks(att, x, context: dict, step):
    """ATT SP, one replicated token per row: attention to the keys every rank holds, merged exactly."""
    g = att.kv_gather.group
    q, k, v = _heads(att, x, context)                                    # [b, 1, heads | kv_heads, d]
    if g.rank == step.owner:
        att.kv_cache.write(k.transpose(1, 2), v.transpose(1, 2), step.keep)
    k, v, keep = att.kv_cache.filled()
    bias = context.get(KEY_BIAS)
    if bias is not None:       # no prefill: this rank's slot j holds decoded token rank + N * j
        slots = torch.arange(att.kv_cache.start, att.kv_cache.length, device=keep.device)
        bias = bias[..., g.rank + g.size * slots]
    o, lse = partial_attention(q.transpose(1, 2), k, v, keep, att.scale, bias)   # [b, heads, 1, d], [b, heads, 1]
    return merge_across_ranks(o, lse, g, step.link).to(q.dtype)


def merge_across_ranks(o, lse, group, link=None):
    """One query per row attended by every rank of `group` to its own keys, o [b, heads, 1, d] and
    lse [b, heads, 1] (fp32, partial_attention's) -> the attention over all their keys, [b, 1,
    heads*d] on every rank: one all-gather of [b, 1, heads, d + 1] (over the group's TokenLink
    `link` where the engine has one) and the exact merge."""
    parts = torch.cat((o, lse.unsqueeze(-1)), dim=-1).transpose(1, 2).contiguous()   # [b, 1, heads, d + 1]
    if link is not None:
        every = torch.cat(link.exchange(parts), dim=1)                      # [b, N, heads, d + 1]
    else:
        every = all_gather_sequence(parts, (1,) * group.size, group.pg)    # [b, N, heads, d + 1]
    o_all, lse_all = every[..., :-1], every[..., -1]
    total = torch.logsumexp(lse_all, dim=1, keepdim=True)                  # [b, 1, heads]
    merged = (torch.exp(lse_all - total).unsqueeze(-1) * o_all).sum(dim=1)  # [b, heads, d]
    return merged.flatten(1).unsqueeze(1)                                # [b, 1, heads*d]


def partial_attention(q, k, v, keep, scale=None, bias=None):
    """Attention of q [b, heads, s, d] over some keys k, v [b, kv_heads, T, d] (keep [b, T]: real
    keys; bias: added to the scores, [1 | b, heads, s, T]) -> (o [b, heads, s, d], lse [b, heads, s]),
    in fp32. A row with no real key among them gets o = 0 and lse = -inf, i.e. no weight in a
    log-sum-exp merge."""
    b, heads, s, d = q.shape
    g = heads // k.shape[1]                                              # query heads per K/V head
    qg = q.float().unflatten(1, (k.shape[1], g))                         # [b, kv_heads, g, s, d]
    scores = qg @ k.float().unsqueeze(2).transpose(-1, -2)               # [b, kv_heads, g, s, T]
    scores = scores * (scale if scale is not None else d ** -0.5)
    if bias is not None:
        scores = scores + bias.float().unflatten(1, (k.shape[1], g))
    scores = scores.masked_fill(~keep[:, None, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                                # [b, kv_heads, g, s]
    weights = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0.0).unsqueeze(-1))
    o = weights @ v.float().unsqueeze(2)                                 # [b, kv_heads, g, s, d]
    return o.flatten(1, 2), lse.flatten(1, 2)


def attend_memory(att, x, memory, keys):
    """A cross-attention's decode step: x [b, 1, h] (a decoder token per row, replicated) over the
    K/V of the encoder's output in att's cache, which the first pass (the prefill, memory
    [b, S, h] given) fills for the rank's heads, or under SP for its source tokens (memory_rows);
    later passes need no memory (None). keys: the encoder's padding mask [b, 1, 1, S].
    -> context [b, 1, heads*d]: under SP each rank attends to its own source tokens and the
    partial results are merged across the group (merge_across_ranks)."""
    cache = att.kv_cache
    q_name, k_name, v_name = att.qkv_names
    if cache.length == 0:
        own = att.memory_rows
        memory = memory[:, own]                                          # [b, S_r, h] (SP), else [b, S, h]
        k, v = (split_heads(getattr(att, n)(memory), att.head_dim).transpose(1, 2) for n in (k_name, v_name))
        cache.write(k, v, keys[:, 0, 0, own])                            # [b, kv_heads, S_r, d], [b, S_r]
    q = split_heads(getattr(att, q_name)(x), att.head_dim).transpose(1, 2)   # [b, heads, 1, d]
    k, v, keep = cache.filled()
    if att.memory_group is not None:
        o, lse = partial_attention(q, k, v, keep, att.scale)            # [b, heads, 1, d], [b, heads, 1]
        return merge_across_ranks(o, lse, att.memory_group).to(q.dtype)
    ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :], scale=att.scale,
                                         enable_gqa=att.group > 1)
    return ctx.transpose(1, 2).flatten(2)
