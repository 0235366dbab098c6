"""Ladder side-tuning (LST, Sung et al. 2022): a slim side network beside a frozen backbone.

With width w = hidden / side_reduction_factor and L backbone layers:

    s_0 = down_0(e)                                   e: the backbone's embeddings output
    s_i = block_i(mu_i * down_i(h_i) + (1 - mu_i) * s_{i-1}),  i = 1..L
                                                      h_i: backbone layer i's output (the residual
                                                      stream), mu_i = sigmoid(alpha_i / 0.1),
                                                      alpha_i = 0 at the start (LST's gates)
    use_side:       head(h_L + up(norm(s_L)))         up = 0 at the start: the base model's outputs
    use_side_only:  head(up(norm(s_L)))

block_i is a pre-norm transformer layer of width w (self-attention with the backbone's mask,
gcd(w, heads) heads, GELU MLP of 4w). The down_i are the ladders. The backbone (embeddings and
layers) runs under torch.no_grad(): its activations are inputs, nothing back-propagates through
it or is kept for a backward pass. Only the side network and the task head train.

use_side_only is the side network alone: no ladders. It reads the backbone's embeddings and
nothing else, so the backbone's transformer layers are never run (its forward is only the
embedding layer); the side blocks then see s_i = block_i(s_{i-1}). The task head (BERT: pooler,
classifier; Llama: lm_head) reads the up-projected side state. Nothing is fed random tensors.

Layout: the side state lives in the CON layout of the plan, like the residual stream it reads.
Under CON SP each rank runs the side network on its own tokens, its attention gathers K and V
over the group (as SP attention does), and every side parameter's gradient is summed over the
group (rule "sum"); under CON None and serially it runs on the full sequence ("replicated").
"""
from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from galaxy.distributed.transitions import Layout, gather_for_sharded_consumer
from galaxy.peft.seeding import init_linear, named_generator

GATE_TEMPERATURE = 0.1    # LST: mu = sigmoid(alpha / T)
# The model's attributes that hold the side network's ends: the first pipeline stage builds the
# input, the last the output (add_side).
SIDE_FIRST, SIDE_LAST = ("side_in",), ("side_out",)


class SideAttention(nn.Module):
    def __init__(self, width: int, heads: int, device=None):
        super().__init__()
        self.heads, self.head_dim = heads, width // heads
        self.qkv = nn.Linear(width, 3 * width, device=device)
        self.out = nn.Linear(width, width, device=device)
        self.kv_gather = None      # CON SP: gathers K/V of every rank's tokens
        self.local_rows = None     # CON SP: own query rows of a [b, 1, S, S] mask

    def forward(self, x, mask):
        # x: [b, s, w] (s = own tokens under SP); mask: [b, 1, 1|S, S] bool or None
        b, s, w = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        if self.kv_gather is not None:
            k, v = self.kv_gather(torch.cat((k, v), dim=-1)).chunk(2, dim=-1)   # [b, S, w] each
            if mask is not None and mask.shape[2] > 1:
                mask = mask[:, :, self.local_rows]
        q = q.view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, k.shape[1], self.heads, self.head_dim).transpose(1, 2)
        v = v.view(b, v.shape[1], self.heads, self.head_dim).transpose(1, 2)
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(ctx.transpose(1, 2).reshape(b, s, w))


class SideBlock(nn.Module):
    """Pre-norm transformer layer of the side network."""

    def __init__(self, width: int, heads: int, eps: float, device=None):
        super().__init__()
        self.norm1 = nn.LayerNorm(width, eps=eps, device=device)
        self.attn = SideAttention(width, heads, device)
        self.norm2 = nn.LayerNorm(width, eps=eps, device=device)
        self.up = nn.Linear(width, 4 * width, device=device)
        self.down = nn.Linear(4 * width, width, device=device)

    def forward(self, s, mask):
        s = s + self.attn(self.norm1(s), mask)
        return s + self.down(F.gelu(self.up(self.norm2(s))))


class SideLayer(nn.Module):
    """Side block i with its ladder from backbone layer i (none in side-only)."""

    def __init__(self, hidden: int, width: int, heads: int, eps: float, ladder: bool, device=None,
                 block=SideBlock):
        super().__init__()
        self.block = block(width, heads, eps, device)
        self.ladder = nn.Linear(hidden, width, device=device) if ladder else None
        self.gate = nn.Parameter(torch.zeros((), device=device)) if ladder else None

    def gated(self, s, h):
        """The block's input: s [b, s_con, w] mixed with the ladder of h [b, s_con, hidden]
        (the backbone's output, no autograd); s itself in side-only."""
        if self.ladder is None:
            return s
        mu = torch.sigmoid(self.gate / GATE_TEMPERATURE)
        return mu * self.ladder(h) + (1 - mu) * s

    def forward(self, s, h, context):
        return self.block(self.gated(s, h), context.get("mask"))


class SideInput(nn.Module):
    def __init__(self, hidden: int, width: int, device=None):
        super().__init__()
        self.down = nn.Linear(hidden, width, device=device)

    def forward(self, e):
        return self.down(e)


class SideOutput(nn.Module):
    """h + up(norm(s)) (use_side) or up(norm(s)) (side-only): what the task head reads."""

    def __init__(self, hidden: int, width: int, eps: float, only: bool, device=None):
        super().__init__()
        self.norm = nn.LayerNorm(width, eps=eps, device=device)
        self.up = nn.Linear(width, hidden, device=device)
        self.only = only

    def forward(self, h, s):
        y = self.up(self.norm(s))
        return y if self.only else h + y


def side_shape(cfg, factor: int) -> tuple[int, int]:
    """(width, heads) of the side network."""
    if factor < 1 or cfg.hidden_size % factor:
        raise ValueError(f"side_reduction_factor {factor} must divide the hidden size {cfg.hidden_size}")
    width = cfg.hidden_size // factor
    return width, math.gcd(width, cfg.num_attention_heads)


@torch.no_grad()
def _init(module: nn.Module, prefix: str, seed: int, std: float) -> None:
    for name, sub in module.named_modules():
        if isinstance(sub, nn.Linear):
            init_linear(sub, named_generator(seed, f"{prefix}.{name}" if name else prefix), std)


def add_side(model: nn.Module, factor: int, only: bool, seed: int, rule) -> dict:
    """Attach the side network (model.side_in, layers[i].side, model.side_out) and switch the
    model's forward to side-tuning; returns the new parameters' rules.

    On a pipeline stage (galaxy.pipeline.stage.keep_stage) only its part is built: side_in on
    the first stage, the side blocks of its own layers, side_out on the last. Every part is
    drawn from the seed and its full-model name, so the stages together hold exactly the
    serial model's side network; the side state travels between stages with the carry.
    """
    cfg = model.config
    width, heads = side_shape(cfg, factor)
    # The backbone's norm epsilon, under whichever name its config gives it (BERT, GPT-2, Llama).
    eps = (getattr(cfg, "layer_norm_eps", None) or getattr(cfg, "layer_norm_epsilon", None)
           or getattr(cfg, "rms_norm_eps", 1e-6))
    std = getattr(cfg, "initializer_range", 0.02)
    device = next(model.parameters()).device
    group = model.attached.group
    first, last = model.attached.is_first_stage, model.attached.is_last_stage
    modules = []
    two_stacks = model.encoder_layers > 0
    if two_stacks:      # an encoder-decoder's side network has a stack beside each (galaxy.peft.side_seq2seq)
        from galaxy.peft.side_seq2seq import SideInputs, plan_side_sequence, side_layer
    if first:
        model.side_in = (SideInputs if two_stacks else SideInput)(cfg.hidden_size, width, device)
        _init(model.side_in, "side_in", seed, std)
        modules.append(("side_in", model.side_in))
    make = side_layer if two_stacks else (lambda _, *args: SideLayer(*args))
    for i, layer in model.layers.named_children():      # i: the global layer index
        layer.side = make(layer, cfg.hidden_size, width, heads, eps, not only, device)
        _init(layer.side, f"layers.{i}.side", seed, std)
        if two_stacks:
            plan_side_sequence(model, layer, group)
        elif model.attached.plan.con_layout == Layout.S and group.size > 1:
            layer.side.block.attn.kv_gather = partial(gather_for_sharded_consumer, group=group)
            layer.side.block.attn.local_rows = slice(group.token_offset, group.token_offset + group.tokens[group.rank])
        modules.append((f"layers.{i}.side", layer.side))
    if last:
        model.side_out = SideOutput(cfg.hidden_size, width, eps, only, device)
        # use_side starts from the backbone's own outputs; side-only has no backbone output to keep.
        _init(model.side_out, "side_out", seed, std if only else 0.0)
        modules.append(("side_out", model.side_out))
    model.side_mode = "side_only" if only else "side"
    model.side_width, model.side_heads = width, heads
    return {f"{prefix}.{n}": rule for prefix, module in modules for n, _ in module.named_parameters()}


def describe_side(model: nn.Module) -> str:
    cfg, encoder = model.config, model.encoder_layers
    # An encoder-decoder's config counts its stacks apart (T5: num_decoder_layers, BART: decoder_layers).
    decoder = (getattr(cfg, "num_decoder_layers", None) or cfg.decoder_layers) if encoder else 0
    layers = encoder + decoder if encoder else cfg.num_hidden_layers
    stacks = f" ({encoder} encoder, {decoder} decoder)" if encoder else ""
    blocks = f"{layers} side blocks{stacks} of width {model.side_width} ({model.side_heads} heads)"
    if model.side_mode == "side_only":
        return (f"side-only: the frozen embeddings -> down-projection -> {blocks} -> up-projection "
                f"-> task head; the backbone's {layers} transformer layers are not run")
    return (f"ladder side-tuning: {blocks}, each fed by a gated down-projection of the backbone "
            f"layer's output; task head reads backbone output + up-projection; the backbone runs "
            f"without autograd")
