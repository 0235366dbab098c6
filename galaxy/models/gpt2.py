"""GPT-2 for causal language modelling (Hugging Face GPT2LMHeadModel): the one definition every
plan is applied to.

Pre-norm layers, structured as galaxy's Llama (galaxy.models.llama):
  ATT  = self-attention: fused Q/K/V projection c_attn, causal scaled dot-product attention,
         output projection c_proj (bias deferred to CON)
  CON1 = dropout(attention output + bias) (resid_pdrop), residual add, then ln_2 (input of the MLP)
  MLP  = c_fc, GELU ("gelu_new"), c_proj (bias deferred)
  CON2 = dropout(MLP output + bias), residual add, then the NEXT layer's ln_1 (ln_f after the last)
The first layer's ln_1 runs before the first block (`first_norm`), on the CON layout. Embeddings
are token (wte) plus learned position (wpe) embeddings, then dropout (embd_pdrop); the LM head
is tied to wte (tie_word_embeddings) and shared with Llama (galaxy.models.causal_lm_head).

Layout: Hugging Face stores every projection as a Conv1D, weight [in, out]; galaxy holds them as
nn.Linear, weight [out, in] (the registry's hf_transposed names them, so that loading, exports,
checkpoints and peft files transpose exactly those). c_attn's rows are [q; k; v], hidden each:
under TP a rank keeps its heads' rows of every block (ParamRule parts 3), so its local output
still splits into its own q, k and v.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from galaxy.distributed.comm_bytes import sum_param_units
from galaxy.distributed.transitions import Transition
from galaxy.layers.activation import activation
from galaxy.layers.block import TransformerBlock
from galaxy.layers.connector import Connector
from galaxy.layers.mlp import FeedForward
from galaxy.layers.self_attention import SelfAttention
from galaxy.models.causal_lm_head import (CausalLMHead, causal_context, causal_lm_comm_bytes,
                                          decoder_matmul_flops)
from galaxy.models.family import GalaxyModel, checked_config
from galaxy.models.weights import NameMap, pre_norm_names


def unsupported(cfg) -> str | None:
    """What of GPT2Config this definition does not compute, or None."""
    if cfg.reorder_and_upcast_attn:
        return ("reorder_and_upcast_attn = true (Hugging Face's upcast attention path for mixed "
                "precision) is not supported by galaxy's GPT-2")
    if cfg.add_cross_attention:
        return "add_cross_attention = true (GPT-2 as a decoder of an encoder) is not supported by galaxy's GPT-2"
    if cfg.n_embd % cfg.n_head:
        return f"n_embd {cfg.n_embd} is not a multiple of n_head {cfg.n_head}"
    return None


def inner_size(cfg) -> int:
    """The MLP width: n_inner, or 4 x n_embd when it is None (as Hugging Face's GPT2Block)."""
    return cfg.n_inner if cfg.n_inner is not None else 4 * cfg.n_embd


def gpt2_layer(cfg, layer_idx: int) -> TransformerBlock:
    """ATT (fused c_attn [3h, h], causal mask; c_proj's bias deferred), CON1 (dropout, residual add,
    ln_2), MLP (c_fc, activation, c_proj), CON2 (dropout, residual add, the next ln_1)."""
    h = cfg.hidden_size
    # Hugging Face's scaling: 1/sqrt(head_dim) (scale_attn_weights), further divided by the
    # layer's 1-based index under scale_attn_by_inverse_layer_idx.
    scale = (h // cfg.num_attention_heads) ** -0.5 if cfg.scale_attn_weights else 1.0
    if cfg.scale_attn_by_inverse_layer_idx:
        scale /= layer_idx + 1
    att = SelfAttention(h, cfg.num_attention_heads, qkv=("c_attn",), out="c_proj", dropout_p=cfg.attn_pdrop,
                        scale=scale, query_dims={"mask": 2})
    con1 = Connector(nn.LayerNorm(h, eps=cfg.layer_norm_epsilon), cfg.resid_pdrop)
    mlp = FeedForward(h, inner_size(cfg), activation(cfg.activation_function), names=("c_fc", "c_proj"))
    con2 = Connector(nn.LayerNorm(h, eps=cfg.layer_norm_epsilon), cfg.resid_pdrop)
    return TransformerBlock(att, con1, mlp, con2)


class GPT2ForCausalLM(CausalLMHead, GalaxyModel):
    con_params = ("first_norm",)
    first_stage_modules = ("wte", "wpe", "first_norm")

    def __init__(self, cfg, **_):
        super().__init__()
        problem = unsupported(cfg)
        if problem:
            raise ValueError(problem)
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.wpe = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.embd_pdrop = cfg.embd_pdrop
        self.first_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_epsilon)
        self.layers = nn.ModuleList(gpt2_layer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.enter = Transition()             # embeddings (R) -> CON layout
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.head_group = None                # set by a plan whose CON layout is S
        self.materialize()

    def materialize(self) -> None:
        """(Re)make the weight tie (lm_head.weight is wte.weight) after the model leaves the meta device."""
        # A pipeline stage may hold one end only (galaxy.pipeline.stage.keep_stage): nothing to tie.
        if self.config.tie_word_embeddings and hasattr(self, "wte") and hasattr(self, "lm_head"):
            self.lm_head.weight = self.wte.weight

    # `carry` is (residual stream, normalised input of the next block), both [b, s_con, h],
    # plus the side state under side-tuning (galaxy.models.family).

    def embed(self, input_ids, token_type_ids=None, positions=None) -> tuple:
        # input_ids: [b, S] on every rank; positions [b, S] (generation's left-padded rows), else
        # 0..S-1 whatever the padding, as Hugging Face numbers them when no position_ids are given
        # (right padding: real tokens come first).
        with self.backbone_grad():
            if positions is None:
                positions = torch.arange(input_ids.shape[1], device=input_ids.device)
            h = self.wte(input_ids) + self.wpe(positions)
            if token_type_ids is not None:     # Hugging Face embeds token types with wte too
                h = h + self.wte(token_type_ids)
            # Replicated activations: every rank draws the same mask from the default stream.
            h = self.enter(F.dropout(h, self.embd_pdrop, self.training))
            x = self.first_norm(h)
        return (h, x) if self.side_in is None else (h, x, self.side_in(h))

    def layer_context(self, attention_mask, positions=None) -> dict:
        """The causal + padding mask for the full sequence, from the [b, S] mask (positions enter
        in embed)."""
        if attention_mask is None:
            raise ValueError("a causal LM needs the attention mask (ones where there is no padding)")
        return causal_context(attention_mask.bool())


def hf_names(cfg):
    """galaxy name -> GPT2LMHeadModel name. CON2 of layer i holds layer i+1's ln_1 (ln_f after the last)."""
    table = NameMap({
        "wte.weight": "transformer.wte.weight",
        "wpe.weight": "transformer.wpe.weight",
        "first_norm.{w}": "transformer.h.0.ln_1.{w}",
        "layers.{i}.att.{rest}": "transformer.h.{i}.attn.{rest}",
        "layers.{i}.con1.norm.{w}": "transformer.h.{i}.ln_2.{w}",
        "layers.{i}.mlp.{rest}": "transformer.h.{i}.mlp.{rest}",
        "lm_head.weight": "lm_head.weight",
        # Parameter-efficient fine-tuning (galaxy.peft): LoRA's lora_A / lora_B sit inside the
        # projections above; adapters and the side network get names of their own.
        "layers.{i}.con1.adapter.{w}": "transformer.h.{i}.attn_output_adapter.{w}",
        "layers.{i}.con2.adapter.{w}": "transformer.h.{i}.mlp_output_adapter.{w}",
        "layers.{i}.side.{rest}": "side.layer.{i}.{rest}",
        "side_in.{rest}": "side.input.{rest}",
        "side_out.{rest}": "side.output.{rest}",
    })
    return pre_norm_names(table, cfg.num_hidden_layers, "transformer.h.{i}.ln_1.{w}", "transformer.ln_f.{w}")


# Hugging Face's Conv1D weights ([in, out]); galaxy's nn.Linear holds them [out, in].
HF_TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# A bare GPT2Model checkpoint (e.g. openai-community/gpt2) has no "transformer." prefix; its LM
# head is the tied wte.
HF_BASE_PREFIX = "transformer."


def config_shape(raw: dict) -> dict:
    """The sizes galaxy.config checks, under their standard names, from a GPT-2 config.json
    (GPT2Config's defaults for keys it leaves out). Raises ValueError for what is unsupported."""
    from transformers import GPT2Config
    cfg = checked_config(GPT2Config, raw, unsupported)
    return {"hidden_size": cfg.n_embd, "num_attention_heads": cfg.n_head, "num_hidden_layers": cfg.n_layer,
            "max_position_embeddings": cfg.n_positions, "intermediate_size": inner_size(cfg)}


# -- closed forms: what the profiler should measure, from the shape and the plan alone --------

def gpt2_matmul_flops(*, batch: int, seq: int, hidden: int, layers: int, heads: int, intermediate: int,
                      vocab: int) -> dict[str, int]:
    """GPT-2 causal LM: plain multi-head attention (c_attn's Q third is "q", its K and V thirds
    "kv", c_proj "o"), a two-matrix MLP (c_fc, c_proj), the tied LM head on every position."""
    return decoder_matmul_flops(batch=batch, seq=seq, hidden=hidden, layers=layers, heads=heads, kv_heads=heads,
                                intermediate=intermediate, vocab=vocab, mlp_matrices=2)


def gpt2_sum_param_units(plan, *, hidden: int, layers: int, intermediate: int, group_size: int) -> list[int]:
    """Elements of GPT-2's gradients summed over the group, per GradientSync unit in backward order.

    Per layer: CON SP: two LayerNorms (ln_2 in CON1, the next ln_1 or ln_f in CON2, weight and
    bias: 2 x 2H) and the two deferred c_proj biases (2H); ATT SP: c_attn [3H, H] and its bias 3H,
    c_proj [H, H]; MLP SP: c_fc [I, H] and its bias I, c_proj [H, I]. Then, under CON SP, the first
    layer's ln_1 before the first block (`first_norm`, 2H), the last unit backward finishes. The
    embeddings and the tied LM head are not summed here.
    """
    h, i = hidden, intermediate
    return sum_param_units(plan, layers=layers, group_size=group_size, con=6 * h, att=4 * h * h + 3 * h,
                           mlp=2 * h * i + i, first=2 * h)


def gpt2_plan_comm_bytes(plan, *, seq_shares, batch: int, hidden: int, layers: int, intermediate: int, vocab: int,
                         comm_chunks: int = 1, element_size: int = 4) -> dict:
    """GPT-2 causal LM: collectives one rank issues in one training step (forward, backward, sync).

    The same transitions as Llama's (galaxy.models.llama.llama_plan_comm_bytes: the residual
    stream never leaves the CON layout; the causal-LM head runs on it), with plain multi-head
    attention: SP attention gathers K and V as one tensor [b, s, 2H] (kv_features = 2H).
    Gradient sync: one all-reduce per bucket of gpt2_sum_param_units.
    """
    units = gpt2_sum_param_units(plan, hidden=hidden, layers=layers, intermediate=intermediate,
                                 group_size=len(seq_shares))
    return causal_lm_comm_bytes(plan, seq_shares=seq_shares, batch=batch, hidden=hidden, layers=layers,
                                kv_features=2 * hidden, vocab=vocab, sum_param_units=units,
                                comm_chunks=comm_chunks, element_size=element_size)


# The spec's entries (galaxy.models.registry): the Hugging Face config in, the forms above out.

def gpt2_shape(cfg) -> dict:
    return dict(hidden=cfg.n_embd, layers=cfg.n_layer, intermediate=inner_size(cfg), vocab=cfg.vocab_size)


def flops_of(cfg, batch: int, seq: int, num_labels=None) -> dict[str, int]:
    return gpt2_matmul_flops(batch=batch, seq=seq, heads=cfg.n_head, **gpt2_shape(cfg))


def comm_of(plan, cfg, batch: int, seq_shares, comm_chunks: int = 1) -> dict:
    return gpt2_plan_comm_bytes(plan, seq_shares=seq_shares, batch=batch, **gpt2_shape(cfg), comm_chunks=comm_chunks)
