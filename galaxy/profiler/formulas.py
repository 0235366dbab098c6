"""FLOP formulas handed to torch's FlopCounterMode (custom_mapping), and the counting convention.

Convention: 2 FLOPs per multiply-add. torch's own formulas count the matrix products (mm, addmm,
bmm, ..., 2*m*k*n; a bias add is not a product and is not in them). This module adds:

* Attention. torch 2.13 has no formula for the CPU kernels of scaled_dot_product_attention
  (`_scaled_dot_product_flash_attention_for_cpu` and its backward), so they count 0. Forward:
  Q K^T and P V, 2 * 2*b*h_q*s_q*s_k*d, dense even when causal (the report says so); grouped-query
  attention counts the h_q query heads, as the kernel broadcasts K/V. Backward: dQ, dK, dV, dP,
  i.e. 2x the forward, on every device (torch's CUDA formulas also count the recomputation of
  Q K^T a flash kernel does; we replace them so that the count is the algorithm's, not the kernel's).
  The softmax inside a fused kernel goes to the element-wise count under FUSED_SOFTMAX.
* Element-wise work (norms, activations, softmax, residual adds, dropout): an estimate, kept apart
  from the matrix products. Cost per output element: 1 for arithmetic and activations, 1 per input
  element for reductions, 4 for softmax, 5 for layer norm, 2x those for their backward kernels.
"""
from __future__ import annotations

import math
from collections import Counter

import torch

aten = torch.ops.aten

FUSED_SOFTMAX = "softmax (fused in attention)"   # pseudo-op key in the element-wise counts
SOFTMAX_COST = 4                                 # max, exp, sum, divide per score

_ATTENTION_FORWARD = ("_scaled_dot_product_flash_attention_for_cpu",)
_ATTENTION_BACKWARD = ("_scaled_dot_product_flash_attention_for_cpu_backward",
                       "_scaled_dot_product_flash_attention_backward",
                       "_scaled_dot_product_efficient_attention_backward",
                       "_scaled_dot_product_cudnn_attention_backward")

# op name -> (FLOPs per element, which tensor's elements: "out" or "in")
_ELEMENTWISE = {
    **{op: (1, "out") for op in (
        "add", "add_", "sub", "sub_", "rsub", "mul", "mul_", "div", "div_", "neg", "addcmul",
        "tanh", "gelu", "silu", "relu", "sigmoid", "exp", "log", "rsqrt", "sqrt", "pow", "reciprocal",
        "native_dropout", "masked_fill", "where", "clamp", "lerp")},
    **{op: (2, "out") for op in (
        "tanh_backward", "gelu_backward", "silu_backward", "sigmoid_backward", "threshold_backward",
        "native_dropout_backward")},
    **{op: (1, "in") for op in ("sum", "mean", "amax", "var_mean", "embedding_dense_backward",
                                "nll_loss_forward", "nll_loss_backward")},
    **{op: (SOFTMAX_COST, "out") for op in ("_softmax", "_safe_softmax", "_log_softmax")},
    **{op: (2 * SOFTMAX_COST, "out") for op in ("_softmax_backward_data", "_log_softmax_backward_data")},
    "native_layer_norm": (5, "out"),
    "native_layer_norm_backward": (10, "in"),
    "_fused_rms_norm": (4, "out"),
    "_fused_rms_norm_backward": (8, "in"),
}


def _numel(shape) -> int:
    while isinstance(shape, (tuple, list)) and shape and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = shape[0]                      # multi-output op: the first output
    return math.prod(shape) if isinstance(shape, (tuple, list, torch.Size)) else 1


def attention_flops(q_shape, k_shape) -> int:
    """Q K^T and P V for q [b, h_q, s_q, d] and k [b, h_kv, s_k, d] (v's last dim = d)."""
    b, h_q, s_q, d = q_shape
    return 2 * (2 * b * h_q * s_q * k_shape[2] * d)


def elementwise_ops() -> frozenset:
    return frozenset(getattr(aten, name) for name in _ELEMENTWISE if hasattr(aten, name))


class Formulas:
    """The custom_mapping for FlopCounterMode, plus the element-wise work of fused attention.

    `fused` counts what no op key can carry (the softmax inside a fused attention kernel); the
    profiler reads it next to the counter's own totals.
    """

    def __init__(self):
        self.fused: Counter = Counter()
        self.saw_causal = False
        self.mapping = {}
        for name in _ATTENTION_FORWARD:
            if hasattr(aten, name):
                self.mapping[getattr(aten, name)] = self._attention_forward
        for name in _ATTENTION_BACKWARD:
            if hasattr(aten, name):
                self.mapping[getattr(aten, name)] = self._attention_backward
        for name, (cost, which) in _ELEMENTWISE.items():
            if hasattr(aten, name):
                self.mapping[getattr(aten, name)] = _elementwise_formula(cost, which)

    def _attention_forward(self, q, k, v, dropout_p=0.0, is_causal=False, *args, out_shape=None, **kwargs):
        self.saw_causal |= bool(is_causal)
        b, h_q, s_q, _ = q
        self.fused[FUSED_SOFTMAX] += SOFTMAX_COST * b * h_q * s_q * k[2]
        return attention_flops(q, k)

    def _attention_backward(self, grad_out, q, k, v, *args, out_shape=None, **kwargs):
        b, h_q, s_q, _ = q
        self.fused[FUSED_SOFTMAX] += 2 * SOFTMAX_COST * b * h_q * s_q * k[2]
        return 2 * attention_flops(q, k)


def _elementwise_formula(cost: int, which: str):
    def formula(*args, out_shape=None, **kwargs):
        if which == "in":
            return cost * _numel(args[0] if args else out_shape)
        return cost * _numel(out_shape)
    return formula
