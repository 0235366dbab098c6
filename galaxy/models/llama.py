"""Llama for causal language modelling and sequence classification: the one definition every
plan is applied to (one backbone, LlamaBackbone; two heads).

Pre-norm layers split as docs/design.md section 1 says:
  ATT  = self-attention (rotary, grouped-query) with its output projection
  CON1 = residual add of the attention output, then post_attention_layernorm (input of the MLP)
  CON2 = residual add of the MLP output, then the NEXT layer's input_layernorm
         (the final norm after the last layer)
The first layer's input_layernorm runs before the first block (`first_norm`), on the CON layout.
Each CON returns (residual stream, normalised input of the next sub-block).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from galaxy.distributed.comm_bytes import sum_param_units
from galaxy.distributed.transitions import Layout, Transition
from galaxy.layers.activation import activation
from galaxy.layers.block import TransformerBlock
from galaxy.layers.connector import Connector
from galaxy.layers.mlp import FeedForward
from galaxy.layers.rms_norm import RMSNorm
from galaxy.layers.rotary import rotary
from galaxy.layers.self_attention import SelfAttention
from galaxy.models.causal_lm_head import (CausalLMHead, causal_context, causal_lm_comm_bytes,
                                          decoder_matmul_flops)
from galaxy.models.family import GalaxyModel
from galaxy.models.pooling import pooled_tokens
from galaxy.models.weights import NameMap, pre_norm_names


def llama_layer(cfg, qkv_bias: bool, out_bias: bool, mlp_bias: bool) -> TransformerBlock:
    """ATT (grouped-query attention with rotary positions, causal mask; o_proj's bias deferred),
    CON1 (residual add, post_attention_layernorm), MLP (SwiGLU), CON2 (residual add, the next
    layer's input_layernorm). No dropout in the residual path."""
    h = cfg.hidden_size
    att = SelfAttention(h, cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
                        head_dim=getattr(cfg, "head_dim", None), qkv=("q_proj", "k_proj", "v_proj"), out="o_proj",
                        qkv_bias=qkv_bias, out_bias=out_bias, dropout_p=cfg.attention_dropout, positions=rotary,
                        query_dims={"mask": 2, "cos": 1, "sin": 1})
    con1 = Connector(RMSNorm(h, cfg.rms_norm_eps))
    mlp = FeedForward(h, cfg.intermediate_size, activation(cfg.hidden_act), names=("gate_proj", "up_proj", "down_proj"),
                      bias=mlp_bias)
    con2 = Connector(RMSNorm(h, cfg.rms_norm_eps))
    return TransformerBlock(att, con1, mlp, con2)


class LlamaBackbone(GalaxyModel):
    """Embeddings, the first input norm and the layers: what both Llama heads share."""
    con_params = ("first_norm",)
    first_stage_modules = ("embed_tokens", "first_norm")
    carry_size = 2           # (residual stream, normalised input of the next sub-block)

    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id)
        self.first_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(llama_layer(cfg, **self.biases(cfg)) for _ in range(cfg.num_hidden_layers))
        self.enter = Transition()             # embeddings (R) -> CON layout

    @staticmethod
    def biases(cfg) -> dict:
        """Which projections carry a bias: Llama's two switches (Qwen2 answers otherwise)."""
        return {"qkv_bias": cfg.attention_bias, "out_bias": cfg.attention_bias, "mlp_bias": cfg.mlp_bias}

    def materialize(self) -> None:
        """(Re)create what is not a checkpoint tensor: rotary tables, weight tying."""
        # transformers' rotary tables handle every rope_type of the config; imported here, as the
        # model is built, so that importing the family costs no transformers modeling import.
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
        self.rotary = LlamaRotaryEmbedding(self.config)
        # A pipeline stage may hold one end only (galaxy.pipeline.stage.keep_stage): nothing to tie.
        if self.config.tie_word_embeddings and hasattr(self, "embed_tokens") and hasattr(self, "lm_head"):
            self.lm_head.weight = self.embed_tokens.weight

    # `carry` is (residual stream, normalised input of the next block), both [b, s_con, h],
    # plus the side state under side-tuning (galaxy.models.family).

    def embed(self, input_ids, token_type_ids=None, positions=None) -> tuple:
        # positions: unused here (rotary positions enter in layer_context)
        with self.backbone_grad():
            h = self.enter(self.embed_tokens(input_ids))
            x = self.first_norm(h)
        return (h, x) if self.side_in is None else (h, x, self.side_in(h))

    def layer_context(self, attention_mask, positions=None) -> dict:
        """Causal + padding mask and rotary tables for the full sequence, from the [b, S] mask
        (None: no padding); positions [b, S]: each token's (None: 0..S-1, right padding's)."""
        if attention_mask is None:
            raise ValueError("a causal LM needs the attention mask (ones where there is no padding)")
        b, S = attention_mask.shape
        if positions is None:
            positions = torch.arange(S, device=attention_mask.device).expand(b, S)
        # Any parameter gives the rotary tables' dtype and device (a pipeline stage may lack
        # the embeddings).
        cos, sin = self.rotary(next(self.parameters()), positions)       # [b, S, d]
        # [b, S, 1, d]: broadcast over the heads once here, not in every layer's q and k (a
        # decode step made 4 views a layer of them)
        return {**causal_context(attention_mask.bool()), "cos": cos[:, :, None], "sin": sin[:, :, None]}

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, labels=None):
        # input_ids, attention_mask, labels: [b, S] on every rank (labels [b] for a classifier);
        # token_type_ids: taken as every family's forward takes them (classification batches
        # carry them), unused: Llama has no token types
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        return super().forward(input_ids, attention_mask, labels=labels)


class LlamaForCausalLM(CausalLMHead, LlamaBackbone):
    """The head, loss and plan_head are the decoders' shared ones (galaxy.models.causal_lm_head)."""

    def __init__(self, cfg, **_):
        super().__init__(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.head_group = None                # set by a plan whose CON layout is S
        self.materialize()


class LlamaForSequenceClassification(LlamaBackbone):
    """Hugging Face's LlamaForSequenceClassification: `score` (no bias) on the final-norm hidden
    state of each row's last token; the loss is the mean cross-entropy over the rows.

    Which token: HF takes the rightmost position whose input id is not pad_token_id. The head
    here sees no token ids (a pipeline's last stage has only the attention mask), so it takes the
    rightmost position the attention mask keeps: the same token for right-padded rows whose pad
    id appears only as padding, which is what galaxy's batches are (a row of padding only: 0, as
    HF). layer_context records the positions; the head of the same forward pass reads them
    (torch's pipeline schedules run a micro-batch's loss right after its last-stage forward).
    """
    task, peft_task_type = "classification", "SEQ_CLS"
    modules_to_save = output_heads = ("score",)
    classes_layer = "score"
    last_stage_modules = ("score",)

    def __init__(self, cfg, num_labels: int, **_):
        super().__init__(cfg)
        self.num_labels = num_labels
        self.score = nn.Linear(cfg.hidden_size, num_labels, bias=False)
        self.pooled_at = None                 # [b] positions of the current forward pass
        self.pool_group = None                # the group holding the tokens' shards under CON SP
        self.materialize()

    def plan_head(self, con_layout, group) -> dict:
        """The pooled tokens are gathered to every rank, so the logits are whole (head_group stays
        None) and the score weight's gradient is complete on every rank."""
        self.pool_group = group if con_layout == Layout.S and group.size > 1 else None
        return {}

    def layer_context(self, attention_mask, positions=None) -> dict:
        slots = torch.arange(attention_mask.shape[1], device=attention_mask.device)
        self.pooled_at = (slots * attention_mask.bool()).argmax(-1)
        return super().layer_context(attention_mask, positions)

    def head(self, carry: tuple, labels=None):
        _, x, *side = carry
        if side:
            x = self.side_out(x, side[0])
        pooled = pooled_tokens(x, self.pooled_at, self.pool_group)            # [b, h]
        logits = self.score(pooled)                                      # [b, num_labels]
        loss = F.cross_entropy(logits.float(), labels) if labels is not None else None
        return logits, loss

    def loss_units(self, labels) -> torch.Tensor:
        """How many terms `head`'s loss averages over: one per row."""
        return torch.tensor(labels.shape[0], device=labels.device)


def hf_names(cfg):
    """galaxy name -> LlamaForCausalLM (or ...ForSequenceClassification) name. CON2 of layer i
    holds layer i+1's input norm."""
    table = NameMap({
        "embed_tokens.weight": "model.embed_tokens.weight",
        "first_norm.weight": "model.layers.0.input_layernorm.weight",
        "layers.{i}.att.{rest}": "model.layers.{i}.self_attn.{rest}",
        "layers.{i}.con1.norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
        "layers.{i}.mlp.{rest}": "model.layers.{i}.mlp.{rest}",
        "lm_head.weight": "lm_head.weight",
        "score.weight": "score.weight",            # LlamaForSequenceClassification's head
        # Parameter-efficient fine-tuning (galaxy.peft): LoRA's lora_A / lora_B sit inside the
        # projections above; adapters and the side network get names of their own.
        "layers.{i}.con1.adapter.{w}": "model.layers.{i}.post_attention_adapter.{w}",
        "layers.{i}.con2.adapter.{w}": "model.layers.{i}.mlp_adapter.{w}",
        "layers.{i}.side.{rest}": "side.layer.{i}.{rest}",
        "side_in.{rest}": "side.input.{rest}",
        "side_out.{rest}": "side.output.{rest}",
    })
    return pre_norm_names(table, cfg.num_hidden_layers, "model.layers.{i}.input_layernorm.{w}", "model.norm.{w}")


# -- closed forms: what the profiler should measure, from the shape and the plan alone --------

def llama_matmul_flops(*, batch: int, seq: int, hidden: int, layers: int, heads: int, kv_heads: int,
                       intermediate: int, vocab: int, head_dim: int | None = None) -> dict[str, int]:
    """Llama causal LM: grouped-query attention, SwiGLU (gate, up, down), LM head on every position."""
    return decoder_matmul_flops(batch=batch, seq=seq, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                                intermediate=intermediate, vocab=vocab, head_dim=head_dim, mlp_matrices=3)


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
    qkv_bias = attention_bias if qkv_bias is None else qkv_bias
    h, i, q, kv = hidden, intermediate, heads * head_dim, kv_heads * head_dim
    return sum_param_units(plan, layers=layers, group_size=group_size, first=h,
                           con=2 * h + h * (int(attention_bias) + int(mlp_bias)),
                           att=2 * q * h + 2 * kv * h + (q + 2 * kv if qkv_bias else 0),
                           mlp=3 * h * i + (2 * i if mlp_bias else 0))


def llama_plan_comm_bytes(plan, *, seq_shares, batch: int, hidden: int, layers: int, heads: int, kv_heads: int,
                          intermediate: int, vocab: int, head_dim: int | None = None,
                          attention_bias: bool = False, mlp_bias: bool = False, qkv_bias: bool | None = None,
                          comm_chunks: int = 1, element_size: int = 4) -> dict:
    """Llama causal LM: collectives one rank issues in one training step (forward, backward, sync).

    N ranks, shares s_i, s = max s_i, b x S tokens, hidden H, d = head_dim (H / heads by default).
    Every layer is the same four-transition block as BERT's (galaxy.layers.block): each sub-block
    reads the CON's normalised input x [b, S|s_i, H] and hands its output back; the residual
    stream, the carry's other half, never leaves the CON layout, so it adds no collective. Per
    layer and per TP/SP sub-block (galaxy.distributed.comm_bytes, forward | backward; shards [b, s, H]):
      CON SP,   TP:  S -> R gather | reduce-scatter in, P -> S reduce-scatter | gather out
      CON None, TP:  R -> R copy | all-reduce [b, S, H] in, P -> R all-reduce | identity out
      CON None, SP:  R -> S split | gather in, S -> R gather | split out
      CON SP,   SP:  nothing
    SP attention gathers K and V, rotated, as one tensor [b, s, 2 kv_heads d] (grouped-query:
    kv_heads, not heads), then reduce-scatters its gradient: kv_features = 2 kv_heads d.
    Entry (CON SP): the embeddings run replicated and are split, R -> S (free), whose backward
    all-gathers the gradient [b, s, H]; first_norm runs after the split, on the shards.
    Head (CON SP): the causal-LM head's all-reduces (causal_lm_comm_bytes); under CON None the
    head runs on R: no collective.
    Gradient sync: one all-reduce per bucket of the "sum" parameters (llama_sum_param_units; the
    bias flags are its own).
    """
    d = head_dim or hidden // heads
    units = llama_sum_param_units(plan, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, head_dim=d,
                                  intermediate=intermediate, attention_bias=attention_bias, mlp_bias=mlp_bias,
                                  qkv_bias=qkv_bias, group_size=len(seq_shares))
    return causal_lm_comm_bytes(plan, seq_shares=seq_shares, batch=batch, hidden=hidden, layers=layers,
                                kv_features=2 * kv_heads * d, vocab=vocab, sum_param_units=units,
                                comm_chunks=comm_chunks, element_size=element_size)


# The spec's entries (galaxy.models.registry): the Hugging Face config in, the forms above out.

def llama_shape(cfg) -> dict:
    heads = cfg.num_attention_heads
    return dict(hidden=cfg.hidden_size, layers=cfg.num_hidden_layers, intermediate=cfg.intermediate_size,
                heads=heads, kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
                vocab=cfg.vocab_size, head_dim=getattr(cfg, "head_dim", None))


def flops_of(cfg, batch: int, seq: int, num_labels=None) -> dict[str, int]:
    return llama_matmul_flops(batch=batch, seq=seq, **llama_shape(cfg))


def comm_of(plan, cfg, batch: int, seq_shares, comm_chunks: int = 1) -> dict:
    return llama_plan_comm_bytes(plan, seq_shares=seq_shares, batch=batch, **llama_shape(cfg),
                                 attention_bias=bool(getattr(cfg, "attention_bias", False)),
                                 mlp_bias=bool(getattr(cfg, "mlp_bias", False)), comm_chunks=comm_chunks)
