"""Llama for causal language modelling: the one definition every plan is applied to.

Pre-norm layers split as docs/design.md section 1 says:
  ATT  = self-attention (rotary, grouped-query) with its output projection
  CON1 = residual add of the attention output, then post_attention_layernorm (input of the MLP)
  CON2 = residual add of the MLP output, then the NEXT layer's input_layernorm
         (the final norm after the last layer)
The first layer's input_layernorm runs before the first block (`first_norm`), on the CON layout.
Each CON returns (residual stream, normalised input of the next sub-block).
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from galaxy.distributed.transitions import (Layout, Transition, copy_for_sharded_consumer,
                                            reduce_to_replicated)
from galaxy.layers.block import TransformerBlock
from galaxy.layers.linear import OutputProjection
from galaxy.layers.sharding import shard_column_parallel, shard_row_parallel
from galaxy.models.family import GalaxyModel
from galaxy.models.weights import NameMap

IGNORE_INDEX = -100


class RMSNorm(nn.Module):
    """Normalises in fp32 and casts back before the weight, as Hugging Face's LlamaRMSNorm."""

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class LlamaAttention(nn.Module):
    """ATT: grouped-query attention with rotary positions. Query heads share K/V heads in groups."""

    def __init__(self, cfg):
        super().__init__()
        h = cfg.hidden_size
        self.head_dim = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.group = self.num_heads // self.num_kv_heads           # query heads per K/V head
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = OutputProjection(self.num_heads * self.head_dim, h, bias=bias)
        self.dropout_p = cfg.attention_dropout
        self.kv_gather = None          # SP: gathers K/V of every rank's tokens
        self.local_rows = None         # SP: this rank's query positions in full-sequence inputs
        self.rng_scope = nullcontext

    deferred_bias = "o_proj.bias"

    def shard_tp(self, shares: tuple[int, ...], rank: int) -> dict:
        """Keep this rank's query heads and their K/V heads (shares are whole K/V groups)."""
        d, g = self.head_dim, self.group
        start, count = sum(shares[:rank]), shares[rank]
        shard_column_parallel(self.q_proj, start * d, count * d)
        shard_column_parallel(self.k_proj, start // g * d, count // g * d)
        shard_column_parallel(self.v_proj, start // g * d, count // g * d)
        shard_row_parallel(self.o_proj, start * d, count * d)
        self.num_heads, self.num_kv_heads = count, count // g
        q_sizes = tuple(n * d for n in shares)
        kv_sizes = tuple(n // g * d for n in shares)
        specs = {"q_proj.weight": (0, q_sizes), "k_proj.weight": (0, kv_sizes),
                 "v_proj.weight": (0, kv_sizes), "o_proj.weight": (1, q_sizes)}
        if self.q_proj.bias is not None:
            specs.update({"q_proj.bias": (0, q_sizes), "k_proj.bias": (0, kv_sizes), "v_proj.bias": (0, kv_sizes)})
        return specs

    def forward(self, x, mask, cos, sin):
        # x: [b, s, h] (s = local tokens under SP); mask: [b, 1, S, S] bool (True = attend);
        # cos, sin: [b, S, d] for the full sequence
        b, s, _ = x.shape
        if self.local_rows is not None:      # SP: own queries, all keys
            mask, cos, sin = mask[:, :, self.local_rows], cos[:, self.local_rows], sin[:, self.local_rows]
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        cos, sin = cos[:, :, None], sin[:, :, None]                     # [b, s, 1, d]
        k = k * cos + rotate_half(k) * sin
        if self.kv_gather is not None:       # rotated with global positions, then gathered while
            kv = self.kv_gather.start(torch.cat((k, v), dim=2).flatten(2))    # Q is projected
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim)
        q = q * cos + rotate_half(q) * sin
        if self.kv_gather is not None:
            k, v = kv().unflatten(2, (2 * self.num_kv_heads, self.head_dim)).chunk(2, dim=2)   # [b, S, ...]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))               # [b, heads, s|S, d]
        p = self.dropout_p if self.training else 0.0
        with self.rng_scope() if p > 0 else nullcontext():
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p,
                                                 enable_gqa=self.group > 1)
        ctx = ctx.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim)
        return self.o_proj(ctx), self.o_proj.bias


class LlamaMLP(nn.Module):
    """MLP: SwiGLU, down(act(gate(x)) * up(x))."""

    deferred_bias = "down_proj.bias"

    def __init__(self, cfg):
        super().__init__()
        h, i, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = OutputProjection(i, h, bias=bias)
        self.act = ACT2FN[cfg.hidden_act]

    def shard_tp(self, shares: tuple[int, ...], rank: int) -> dict:
        start, count = sum(shares[:rank]), shares[rank]
        shard_column_parallel(self.gate_proj, start, count)
        shard_column_parallel(self.up_proj, start, count)
        shard_row_parallel(self.down_proj, start, count)
        specs = {"gate_proj.weight": (0, shares), "up_proj.weight": (0, shares), "down_proj.weight": (1, shares)}
        if self.up_proj.bias is not None:
            specs.update({"gate_proj.bias": (0, shares), "up_proj.bias": (0, shares)})
        return specs

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x)), self.down_proj.bias


class LlamaConnector(nn.Module):
    """CON: stream = stream + x (+ bias); returns (stream, norm(stream))."""

    def __init__(self, cfg):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rng_scope = nullcontext   # no dropout in Llama's residual path
        self.adapter = None            # a bottleneck adapter (galaxy.peft.adapter), when one is applied

    def forward(self, x, bias, residual):
        if bias is not None:
            x = x + bias
        if self.adapter is not None:
            x = self.adapter(x)        # x + up(act(down(x))): the adapter's own skip connection
        stream = residual + x
        return stream, self.norm(stream)


class LlamaForCausalLM(GalaxyModel):
    task, peft_task_type = "causal_lm", "CAUSAL_LM"
    output_heads = ("lm_head",)     # applied through its weight (tied, sharded loss): no LoRA
    con_params = ("first_norm",)
    first_stage_modules = ("embed_tokens", "first_norm")
    last_stage_modules = ("lm_head",)
    carry_size = 2           # (residual stream, normalised input of the next sub-block)

    def __init__(self, cfg, **_):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id)
        self.first_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(
            TransformerBlock(LlamaAttention(cfg), LlamaConnector(cfg), LlamaMLP(cfg), LlamaConnector(cfg))
            for _ in range(cfg.num_hidden_layers))
        self.enter = Transition()             # embeddings (R) -> CON layout
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.head_group = None                # set by a plan whose CON layout is S
        self.materialize()

    def materialize(self) -> None:
        """(Re)create what is not a checkpoint tensor: rotary tables, weight tying."""
        self.rotary = LlamaRotaryEmbedding(self.config)   # handles every rope_type of the config
        # A pipeline stage may hold one end only (galaxy.pipeline.stage.keep_stage): nothing to tie.
        if self.config.tie_word_embeddings and hasattr(self, "embed_tokens") and hasattr(self, "lm_head"):
            self.lm_head.weight = self.embed_tokens.weight

    def plan_head(self, con_layout, group) -> dict:
        """The LM head and loss run on the CON layout: under S each rank scores its own tokens."""
        self.head_group = group if con_layout == Layout.S and group.size > 1 else None
        return {}     # the head weight's gradient is all-reduced in backward (see forward)

    # `carry` is (residual stream, normalised input of the next block), both [b, s_con, h],
    # plus the side state under side-tuning (galaxy.models.family).

    def embed(self, input_ids, token_type_ids=None) -> tuple:
        with self.backbone_grad():
            h = self.enter(self.embed_tokens(input_ids))
            x = self.first_norm(h)
        return (h, x) if self.side_in is None else (h, x, self.side_in(h))

    def layer_context(self, attention_mask) -> dict:
        """Causal + padding mask and rotary tables for the full sequence, from the [b, S] mask
        (None: no padding)."""
        if attention_mask is None:
            raise ValueError("a causal LM needs the attention mask (ones where there is no padding)")
        b, S = attention_mask.shape
        positions = torch.arange(S, device=attention_mask.device).expand(b, S)
        # Any parameter gives the rotary tables' dtype and device (a pipeline stage may lack
        # the embeddings).
        cos, sin = self.rotary(next(self.parameters()), positions)       # [b, S, d]
        return {"mask": causal_padding_mask(attention_mask.bool()), "cos": cos, "sin": sin}

    def head(self, carry: tuple, labels=None):
        _, x, *side = carry
        if side:
            x = self.side_out(x, side[0])
        weight, rows = self.lm_head.weight, slice(None)
        if self.head_group is not None:
            # Each rank scores its own tokens: the replicated head weight gets partial gradients.
            g = self.head_group
            weight = copy_for_sharded_consumer(weight, g)
            rows = slice(g.seq_offset, g.seq_offset + g.seq[g.rank])
        logits = F.linear(x, weight)                                     # [b, s_con, vocab]
        if labels is None:
            return logits, None
        # Shift inside the model, as HF does: position t predicts token t + 1.
        targets = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]      # [b, S]
        count = (targets != IGNORE_INDEX).sum().clamp_min(1)
        local = F.cross_entropy(logits.float().flatten(0, 1), targets[:, rows].flatten(),
                                ignore_index=IGNORE_INDEX, reduction="sum") / count
        loss = reduce_to_replicated(local, self.head_group) if self.head_group is not None else local
        return logits, loss

    def loss_units(self, labels) -> torch.Tensor:
        """How many terms `head`'s loss averages over: the label tokens after the shift."""
        return (labels[:, 1:] != IGNORE_INDEX).sum()

    def forward(self, input_ids, attention_mask=None, labels=None):
        # input_ids, attention_mask, labels: [b, S] on every rank; labels use IGNORE_INDEX
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        return super().forward(input_ids, attention_mask, labels=labels)


def causal_padding_mask(keep):
    """[b, S] bool (True = real token) -> [b, 1, S, S]: key k visible to query q if k <= q and real.

    A query that would see no key at all (a sample that is all padding) sees itself, so that
    attention stays finite; such rows carry no loss.
    """
    S = keep.shape[1]
    causal = torch.ones(S, S, dtype=torch.bool, device=keep.device).tril()
    mask = causal & keep[:, None, None, :]
    blind = ~mask.any(-1, keepdim=True)
    return mask | (blind & torch.eye(S, dtype=torch.bool, device=keep.device))


def hf_names(cfg):
    """galaxy name -> LlamaForCausalLM name. CON2 of layer i holds layer i+1's input norm."""
    table = NameMap({
        "embed_tokens.weight": "model.embed_tokens.weight",
        "first_norm.weight": "model.layers.0.input_layernorm.weight",
        "layers.{i}.att.{rest}": "model.layers.{i}.self_attn.{rest}",
        "layers.{i}.con1.norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
        "layers.{i}.mlp.{rest}": "model.layers.{i}.mlp.{rest}",
        "lm_head.weight": "lm_head.weight",
        # Parameter-efficient fine-tuning (galaxy.peft): LoRA's lora_A / lora_B sit inside the
        # projections above; adapters and the side network get names of their own.
        "layers.{i}.con1.adapter.{w}": "model.layers.{i}.post_attention_adapter.{w}",
        "layers.{i}.con2.adapter.{w}": "model.layers.{i}.mlp_adapter.{w}",
        "layers.{i}.side.{rest}": "side.layer.{i}.{rest}",
        "side_in.{rest}": "side.input.{rest}",
        "side_out.{rest}": "side.output.{rest}",
    })
    last = cfg.num_hidden_layers - 1

    def to_hf(name: str) -> str:
        parts = name.split(".")
        if parts[0] == "layers" and parts[2] == "con2" and parts[3] == "norm":
            i = int(parts[1])
            return "model.norm.weight" if i == last else f"model.layers.{i + 1}.input_layernorm.weight"
        return table(name)
    return to_hf
