"""Qwen2 for causal language modelling: Llama (galaxy.models.llama) with biases on q/k/v.

What Hugging Face's Qwen2ForCausalLM (transformers/models/qwen2/modeling_qwen2.py) does
differently from LlamaForCausalLM, and all this file adds:
  - q_proj, k_proj and v_proj always have biases, o_proj never has one; the MLP has none.
    Qwen2Config has neither `attention_bias` nor `mlp_bias` (and a checkpoint's config.json
    must not switch them on), so Qwen2ForCausalLM answers llama.py's `biases` itself.
  - Sliding-window attention on the layers `layer_types` names "sliding_attention"
    (use_sliding_window with i >= max_window_layers): not implemented, refused at build time.
Everything else is Llama's, computed by llama.py: rotary embeddings (the same default and scaled
rope types), RMSNorm, SwiGLU, grouped-query attention, tied or untied embeddings, the shifted
loss. Parameter names match Llama's, so llama.hf_names maps both (galaxy.models.registry).

The q/k/v biases follow their weights under every plan (SelfAttention.shard_tp shards a bias
when there is one): under TP each rank keeps the bias entries of its own query heads and
K/V groups (column-parallel); under SP they are whole "sum" parameters, like the weights.
"""
from __future__ import annotations

from galaxy.models.llama import LlamaForCausalLM, llama_plan_comm_bytes, llama_shape


def check_full_attention(cfg) -> None:
    """Refuse a config with sliding-window layers rather than train it as full attention.

    HF's Qwen2Config derives `layer_types` from use_sliding_window and max_window_layers (layer i
    slides when use_sliding_window and i >= max_window_layers); use_sliding_window with
    max_window_layers >= num_hidden_layers leaves every layer full and is computed exactly.
    """
    types = getattr(cfg, "layer_types", None)
    if types is None:      # a transformers without layer_types: the flag alone decides
        types = ["sliding_attention" if getattr(cfg, "use_sliding_window", False) else "full_attention"]
    sliding = [i for i, t in enumerate(types) if t != "full_attention"]
    if sliding:
        raise ValueError(f"this Qwen2 config has sliding-window attention on layers {sliding} "
                         f"(use_sliding_window {getattr(cfg, 'use_sliding_window', None)}, max_window_layers "
                         f"{getattr(cfg, 'max_window_layers', None)}); galaxy computes full attention only: "
                         "set use_sliding_window to false in config.json")


class Qwen2ForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM whose attention projections q/k/v carry biases (o_proj none)."""

    def __init__(self, cfg, **_):
        check_full_attention(cfg)
        super().__init__(cfg)

    @staticmethod
    def biases(cfg) -> dict:
        """Qwen2's fixed answer, whatever config.json says: q_proj.bias [heads * d], k_proj.bias and
        v_proj.bias [kv_heads * d]; no bias on o_proj or in the MLP."""
        return {"qkv_bias": True, "out_bias": False, "mlp_bias": False}


def comm_of(plan, cfg, batch: int, seq_shares, comm_chunks: int = 1) -> dict:
    """The spec's bytes per collective: Llama's, with q/k/v biases and no o_proj or MLP bias among
    the summed gradients. Qwen2's matmul FLOPs are Llama's (llama.flops_of: a bias adds no
    matrix product)."""
    return llama_plan_comm_bytes(plan, seq_shares=seq_shares, batch=batch, **llama_shape(cfg), qkv_bias=True,
                                 comm_chunks=comm_chunks)
