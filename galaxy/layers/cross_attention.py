"""XATT, the cross-attention sub-block of an encoder-decoder's decoder layer.

Queries come from the decoder's tokens, keys and values from the encoder's output (`memory`,
[b, S_src, h]). The memory reaches every decoder layer whole, on every rank of the Galaxy group:
the model gathers it once per step (galaxy.models.seq2seq), so no layer gathers anything.

  TP   this rank's heads: Q from the decoder's tokens (R, all of them), K and V projected from
       the whole memory for its heads only; the output is a partial sum (P), like ATT's
  SP   this rank's decoder tokens (S): all heads, K and V projected from the whole memory

Either way each rank's use of the memory covers only its heads or its queries, so the memory's
gradient is partial on every rank: the model's gather is one for a sharded consumer (its backward
sums the layers' contributions over the group once, not once per layer).

Everything else is SelfAttention's (projections under the family's names, shard_tp by heads, the
attention core, dropout's stream): only where K and V come from differs, and that under SP
nothing is gathered.

Generation (galaxy.inference.seq2seq_engine): the cache holds the memory's K/V, projected once by
the first decode pass, which gathers the memory whole as training does:

  TP   the rank's heads of every source token                [b, heads_r, S, d]
  SP   all heads of the rank's own source tokens, by the encoder's token shares (S_r of
       group.source_tokens, S = pad_size)                   [b, heads, S_r, d]

Every decode step's token, replicated, attends to it (galaxy.layers.cached_attention.attend_memory):
under SP each rank to its own source tokens, and the partial results are merged exactly by their
log-sum-exp, one all-gather of [b, 1, heads, d + 1] per XATT and token, as ATT SP's decode step.
So under SP the memory's cache is divided over the ranks as the encoder's tokens are.
"""
from __future__ import annotations

from galaxy.distributed.group import GalaxyGroup
from galaxy.layers import cached_attention
from galaxy.layers.kv_cache import KVCache
from galaxy.layers.self_attention import SelfAttention


class CrossAttention(SelfAttention):
    """SelfAttention's arguments (separate q, k, v projections); forward(x, memory, **context)
    with context the cross-attention's layer context (the encoder's padding mask over keys)."""

    def __init__(self, hidden: int, heads: int, **kwargs):
        if len(kwargs["qkv"]) != 3:
            raise ValueError("cross-attention projects Q and K/V from different inputs: name q, k and v apart")
        super().__init__(hidden, heads, **kwargs)
        self.memory_group = None       # SP: the decoder's group (its source_tokens split the memory's cache)

    def sequence_parallel(self, group: GalaxyGroup) -> None:
        """SP: this rank's queries are its own decoder tokens; K and V come from the whole memory,
        so nothing is gathered (only query-indexed context is cut to this rank's rows). While
        generating, the rank caches the K/V of its own source tokens (memory_rows) only."""
        self.local_rows = slice(group.token_offset, group.token_offset + group.tokens[group.rank])
        self.memory_group = group

    def project(self, x, memory):
        """x [b, s, h] (decoder tokens), memory [b, S_src, h] -> (q [b, s, heads*d], k, v [b, S_src, heads*d])."""
        q, k, v = (getattr(self, name) for name in self.qkv_names)
        return q(x), k(memory), v(memory)

    @property
    def memory_rows(self) -> slice:
        """The source tokens whose K/V this rank caches: all of them, or under SP its share."""
        g = self.memory_group
        if g is None:
            return slice(None)
        start = sum(g.source_tokens[:g.rank])
        return slice(start, start + g.source_tokens[g.rank])

    def start_cache(self, rows: int, prompt: int, new: int, dtype, device) -> KVCache:
        """The memory's K/V (`prompt`: the source length S) of this rank's heads, or under SP of
        its source tokens; decoding adds nothing to it, so `new` takes no slot."""
        g = self.memory_group
        if g is not None and prompt != sum(g.source_tokens):
            raise ValueError(f"an SP cross-attention caches the memory by its {sum(g.source_tokens)} source "
                             f"tokens' shares, got a memory of {prompt}")
        slots = prompt if g is None else g.source_tokens[g.rank]
        return KVCache(rows, self.num_kv_heads, slots, self.head_dim, dtype, device)

    @property
    def memory_cached(self) -> bool:
        """Whether the cache holds the memory's K/V already (a decode pass needs no memory then)."""
        return self.kv_cache is not None and self.kv_cache.length > 0

    def forward(self, x, memory, **context):
        # x: [b, s, h] (this rank's decoder tokens under SP); memory: [b, S_src, h] on every rank
        if self.kv_cache is not None:
            return self.finish(cached_attention.attend_memory(self, x, memory, context["mask"]))
        if self.local_rows is not None:
            context = self.own_rows(context)
        return self.finish(self.attend(*self.project(x, memory), **context))
