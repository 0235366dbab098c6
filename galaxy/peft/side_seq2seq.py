"""Ladder side-tuning of an encoder-decoder (BART, T5): LST as Sung et al. built it on T5.

Two side stacks beside the frozen backbone's two, each fed by ladders from its own stack:

    s_0 = down_src(e_src)        t_0 = down_tgt(e_tgt)        e: each stack's entered embeddings
    s_i = block_i(mu_i * ladder_i(h_i) + (1 - mu_i) * s_{i-1})            encoder layers i = 1..E
    t_j = dblock_j(mu_j * ladder_j(g_j) + (1 - mu_j) * t_{j-1}, m)        decoder layers j = 1..D
    m   = s_E, whole on every rank (gathered once per forward of a stage, as the backbone's memory)
    use_side:       head(g_D + up(norm(t_D)))         use_side_only: head(up(norm(t_D)))

block_i is galaxy.peft.side's SideBlock over the source's padding mask; dblock_j is a pre-norm
decoder layer of width w: causal self-attention over the target, cross-attention from its own
queries to norm(m) (its own norm, projections and heads) under the source's padding mask, and
the GELU MLP. Side-only has no ladders: the side stacks read only the embeddings, so neither
backbone stack runs a layer.

The side network's masks are boolean and its own ("side_source", "side_target" in the layer
context): T5's backbone masks carry the relative position bias, split by heads under TP.

Layout: both side states live in the CON layout like the streams they read: under CON SP the
encoder's side state is split by the source token shares (seq_scatter_list), the decoder's by
the target's (decoder_seq_scatter_list). Self-attention gathers K/V over the group with its own
stack's shares; the memory m is gathered once per stage (a gather for a sharded consumer: its
backward sums every rank's partial gradient and hands each rank its own tokens' share).
"""
from __future__ import annotations

from functools import partial

import torch.nn.functional as F
from torch import nn

from galaxy.distributed.transitions import Layout, gather_for_sharded_consumer
from galaxy.peft.side import SideBlock, SideLayer


class SideCrossAttention(nn.Module):
    """The side decoder's queries [b, t, w] against the whole side memory [b, S, w]."""

    def __init__(self, width: int, heads: int, eps: float, device=None):
        super().__init__()
        self.heads, self.head_dim = heads, width // heads
        self.memory_norm = nn.LayerNorm(width, eps=eps, device=device)
        self.q = nn.Linear(width, width, device=device)
        self.kv = nn.Linear(width, 2 * width, device=device)
        self.out = nn.Linear(width, width, device=device)

    def forward(self, x, memory, mask):
        # x: [b, t, w] (own target tokens under SP); memory: [b, S, w]; mask: [b, 1, 1, S] bool
        b, t, w = x.shape
        k, v = self.kv(self.memory_norm(memory)).chunk(2, dim=-1)

        def heads(y):
            return y.view(b, y.shape[1], self.heads, self.head_dim).transpose(1, 2)
        ctx = F.scaled_dot_product_attention(heads(self.q(x)), heads(k), heads(v), attn_mask=mask)
        return self.out(ctx.transpose(1, 2).reshape(b, t, w))


class SideDecoderBlock(SideBlock):
    """Pre-norm side decoder layer: causal self-attention, cross-attention to the memory, MLP."""

    def __init__(self, width: int, heads: int, eps: float, device=None):
        super().__init__(width, heads, eps, device)
        self.norm_cross = nn.LayerNorm(width, eps=eps, device=device)
        self.cross = SideCrossAttention(width, heads, eps, device)

    def forward(self, s, mask, memory=None, cross=None):
        s = s + self.attn(self.norm1(s), mask)
        s = s + self.cross(self.norm_cross(s), memory, cross)
        return s + self.down(F.gelu(self.up(self.norm2(s))))


class SideDecoderLayer(SideLayer):
    """Side decoder block j with its ladder from backbone decoder layer j (none in side-only)."""

    def __init__(self, hidden: int, width: int, heads: int, eps: float, ladder: bool, device=None):
        super().__init__(hidden, width, heads, eps, ladder, device, block=SideDecoderBlock)

    def forward(self, s, h, context, memory=None):
        # s: [b, t_con, w]; h: [b, t_con, hidden] (no autograd); memory: [b, S, w] whole
        return self.block(self.gated(s, h), context["mask"], memory, context["cross"])


class SideInputs(nn.Module):
    """The two side stacks' first states from the two stacks' entered embeddings."""

    def __init__(self, hidden: int, width: int, device=None):
        super().__init__()
        self.source = nn.Linear(hidden, width, device=device)
        self.target = nn.Linear(hidden, width, device=device)

    def forward(self, source, target):
        # source [b, s_src, hidden], target [b, s_tgt, hidden] (CON layout) -> the same at width w
        return self.source(source), self.target(target)


def side_layer(layer, hidden: int, width: int, heads: int, eps: float, ladder: bool, device) -> SideLayer:
    """The side layer beside backbone layer `layer`: a decoder's for a decoder layer."""
    kind = SideDecoderLayer if layer.sequence == "target" else SideLayer
    return kind(hidden, width, heads, eps, ladder, device)


def plan_side_sequence(model, layer, group) -> None:
    """Under a sharded CON layout: the side self-attention of `layer` gathers K/V over its own
    stack's token shares, and the model gathers the side memory over the source's."""
    if model.attached.plan.con_layout != Layout.S or group.size == 1:
        return
    stack = group.decoder() if layer.sequence == "target" else group
    attn = layer.side.block.attn
    attn.kv_gather = partial(gather_for_sharded_consumer, group=stack)
    attn.local_rows = slice(stack.token_offset, stack.token_offset + stack.tokens[stack.rank])
    model.side_memory = partial(gather_for_sharded_consumer, group=group)
