"""ATT, the one attention sub-block every family builds: what a plan changes lives here.

A family describes its attention and this module runs it under any plan (torchtitan's and
Megatron core's split: the model names its parts, the parallel machinery is written once):

  the family supplies           its projections' Hugging Face names (`qkv`: q, k, v apart, or one
                                fused [q; k; v] projection; `out`), their biases, the head shape
                                (heads, K/V heads for grouped-query attention, head_dim), and its
                                core: the scale, dropout, how positions enter Q and K
                                (`positions`: Llama's rotary) and which layer_context tensors are
                                indexed by query position (`query_dims`: a [b, 1, S, S] mask's
                                rows, Llama's [b, S, 1, d] rotary tables)
  SelfAttention owns            TP: shard_tp keeps this rank's heads and their K/V heads;
                                SP: sequence_parallel(group) gathers K and V over the group
                                (`kv_gather`), cuts the query-indexed context to this rank's rows
                                (`local_rows`) and, with `kv_blocks` (set_overlap), attends to the
                                own keys while the gather travels (attention_while_gathering);
                                dropout's stream (`rng_scope`, ShardedDropout); the KV cache of
                                generation (`kv_cache`, galaxy.layers.cached_attention)

The forward, outside SP, is finish(attend(*project(x))): `project` and `finish` work token by
token, `attend` over the whole sequence in order, so a TP ATT whose transitions travel in chunks
(galaxy.layers.block, galaxy.distributed.overlap.chunked_attention) calls the three itself.
"""
from __future__ import annotations

from typing import Callable

from torch import nn

from galaxy.distributed.group import GalaxyGroup
from galaxy.layers import cached_attention
from galaxy.distributed.transitions import KVGather
from galaxy.layers.attention import CAUSAL, attention, attention_while_gathering, split_heads
from galaxy.layers.linear import OutputProjection
from galaxy.layers.rng import ShardedDropout
from galaxy.layers.sharding import shard_column_parallel, shard_row_parallel

# positions(t, context) -> t: queries or keys [b, s, heads, d] at the positions of the context's
# tables (already cut to this rank's rows under SP).
Positions = Callable[[object, dict], object]


class SelfAttention(ShardedDropout, nn.Module):
    """Q/K/V projections -> (positions) -> scaled dot-product attention -> output projection,
    returning (output without its bias, the deferred bias) as the block protocol wants."""

    def __init__(self, hidden: int, heads: int, *, qkv: tuple[str, ...], out: str, kv_heads: int | None = None,
                 head_dim: int | None = None, qkv_bias: bool = True, out_bias: bool = True, dropout_p: float = 0.0,
                 scale: float | None = None, positions: Positions | None = None,
                 query_dims: dict[str, int] | None = None):
        super().__init__()
        self.head_dim = head_dim or hidden // heads
        self.num_heads, self.num_kv_heads = heads, kv_heads or heads
        self.group = self.num_heads // self.num_kv_heads           # query heads per K/V head
        if len(qkv) not in (1, 3):
            raise ValueError(f"an ATT's qkv names are (q, k, v) or one fused [q; k; v] projection, got {qkv}")
        if len(qkv) == 1 and self.group > 1:
            raise ValueError("a fused [q; k; v] projection holds as many K/V heads as query heads")
        self.qkv_names, self.out_name = qkv, out
        d = self.head_dim
        if len(qkv) == 1:     # rows [q; k; v], heads x d each (GPT-2's c_attn)
            setattr(self, qkv[0], nn.Linear(hidden, 3 * heads * d, bias=qkv_bias))
        else:
            for name, width in zip(qkv, (heads * d, self.num_kv_heads * d, self.num_kv_heads * d)):
                setattr(self, name, nn.Linear(hidden, width, bias=qkv_bias))
        setattr(self, out, OutputProjection(heads * d, hidden, bias=out_bias))
        self.dropout_p, self.scale, self.positions = dropout_p, scale, positions
        self.query_dims = dict(query_dims or {})
        self.kv_gather = None          # SP: gathers K/V of every rank's tokens (KVGather)
        self.local_rows = None         # SP: this rank's query positions in full-sequence context
        self.kv_blocks = False         # SP: attend to the own keys while the gather travels
        self.kv_cache = None           # generation: this rank's keys and values so far (KVCache)

    @property
    def deferred_bias(self) -> str:
        """The output projection's bias: CON adds it, after the output's layout transition."""
        return f"{self.out_name}.bias"

    # -- what a plan sets -------------------------------------------------------------------

    def shard_tp(self, shares: tuple[int, ...], rank: int) -> dict:
        """Keep this rank's query heads and their K/V heads (shares are whole K/V groups).
        Returns {param: (dim, per-rank sizes[, parts])} for gathering."""
        d, g, start, count = self.head_dim, self.group, sum(shares[:rank]), shares[rank]
        q_sizes = tuple(n * d for n in shares)
        if len(self.qkv_names) == 1:     # every one of the fused [q; k; v] blocks keeps the same rows
            specs = self._shard_columns(self.qkv_names[0], start * d, count * d, (0, q_sizes, 3), parts=3)
        else:
            q, k, v = self.qkv_names
            kv_sizes = tuple(n // g * d for n in shares)
            specs = {**self._shard_columns(q, start * d, count * d, (0, q_sizes)),
                     **self._shard_columns(k, start // g * d, count // g * d, (0, kv_sizes)),
                     **self._shard_columns(v, start // g * d, count // g * d, (0, kv_sizes))}
        shard_row_parallel(getattr(self, self.out_name), start * d, count * d)
        self.num_heads, self.num_kv_heads = count, count // g
        return {**specs, f"{self.out_name}.weight": (1, q_sizes)}

    def _shard_columns(self, name: str, start: int, length: int, spec: tuple, parts: int = 1) -> dict:
        proj = getattr(self, name)
        shard_column_parallel(proj, start, length, parts)
        return {f"{name}.weight": spec, **({f"{name}.bias": spec} if proj.bias is not None else {})}

    def start_cache(self, rows: int, prompt: int, new: int, dtype, device):
        """A KV cache for `rows` rows of a `prompt`-token prefill and `new` decoded tokens, holding
        what this rank keeps (galaxy.layers.kv_cache: its heads, or under SP its tokens)."""
        return cached_attention.start_cache(self, rows, prompt, new, dtype, device)

    def sequence_parallel(self, group: GalaxyGroup) -> None:
        """SP: this rank holds tokens [o_r, o_r + s_r) of the sequence; its queries attend to
        every rank's keys, gathered over `group`."""
        self.kv_gather = KVGather(group)
        self.local_rows = slice(group.token_offset, group.token_offset + group.tokens[group.rank])

    # -- the block protocol's three pieces ------------------------------------------------

    def project(self, x):
        """Token-wise: x [b, s, h] -> (q [b, s, heads*d], k, v [b, s, kv_heads*d])."""
        if len(self.qkv_names) == 1:
            return getattr(self, self.qkv_names[0])(x).split(self.num_heads * self.head_dim, dim=-1)
        return tuple(getattr(self, name)(x) for name in self.qkv_names)

    def attend(self, q, k, v, **context):
        """Whole sequences in order: q [b, s, heads*d] against k, v [b, S, kv_heads*d] ->
        context [b, s, heads*d]. context: the model's layer_context (mask, position tables)."""
        q, k = (self.at_positions(split_heads(t, self.head_dim), context) for t in (q, k))
        # CAUSAL (no padding): the kernel applies the causal mask itself
        return self._attention(attention, q, k, split_heads(v, self.head_dim), context=context,
                               causal=bool(context.get(CAUSAL)))

    def finish(self, ctx):
        """Token-wise: context -> (output projection without its bias, the deferred bias)."""
        out = getattr(self, self.out_name)
        return out(ctx), out.bias

    def forward(self, x, **context):
        # x: [b, s, h] (s = this rank's tokens under SP); context: the model's layer_context
        if self.kv_cache is not None:
            return self.finish(cached_attention.attend(self, x, context))
        if self.kv_gather is None:
            return self.finish(self.attend(*self.project(x), **context))
        context = self.own_rows(context)
        return self.finish(self.attend_across_ranks(*self.own_keys(x, context), context))

    # -- SP: the two halves of attention across ranks ------------------------------------------

    def own_keys(self, x, context: dict):
        """SP: (a function projecting this rank's queries [b, s, heads, d], its tokens' keys and
        values [b, s, kv_heads, d]), keys at their positions. context: cut to this rank's rows."""
        q_of, k, v = self._projections_for_gather(x)
        k = self.at_positions(split_heads(k, self.head_dim), context)                # [b, s, kv_heads, d]

        def queries():
            return self.at_positions(split_heads(q_of(), self.head_dim), context)   # [b, s, heads, d]
        return queries, k, split_heads(v, self.head_dim)

    def attend_across_ranks(self, queries, k, v, context: dict):
        """SP: this rank's queries over every rank's keys -> context [b, s, heads*d]. The K/V
        gather is started first; the queries are projected while it travels."""
        return self._attention(attention_while_gathering, queries, k, v, self.kv_gather, context=context,
                               blocks=self.kv_blocks)

    # -- inside -----------------------------------------------------------------------------

    def _projections_for_gather(self, x):
        """(a function projecting Q, K, V): K and V first; a fused projection makes all three at once."""
        if len(self.qkv_names) == 1:
            q, k, v = self.project(x)
            return (lambda: q), k, v
        q, k, v = (getattr(self, name) for name in self.qkv_names)
        return (lambda: q(x)), k(x), v(x)

    def own_rows(self, context: dict) -> dict:
        """The context at this rank's queries: each query-indexed tensor cut to local_rows (the
        CAUSAL flag dropped: the rows are a slice, the cut mask holds their causality)."""
        def own(name, t):
            dim = self.query_dims.get(name)
            return t if dim is None else t[(slice(None),) * dim + (self.local_rows,)]
        return {name: own(name, t) for name, t in context.items() if name != CAUSAL}

    def at_positions(self, t, context: dict):
        return t if self.positions is None else self.positions(t, context)

    def _attention(self, core, *args, context: dict, **kwargs):
        # core: attention (args q, k, v) or attention_while_gathering (args q_fn, k, v, gather);
        # heads in, [b, s, heads*d] out
        return core(*args, context.get("mask"), dropout_p=self.dropout_p if self.training else 0.0,
                    rng_scope=self.rng_scope, scale=self.scale, enable_gqa=self.group > 1, **kwargs)
