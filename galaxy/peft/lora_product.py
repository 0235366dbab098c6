"""A LoRA projection's forward and backward as one autograd function, with fewer passes over memory.

    y = x W^T (+ b) + s (x_l A^T) B^T        x [n, in], W [out, in], A [r, in], B [out, r]

x_l is x itself, or LoRA's dropout of it. Written with modules (F.linear, then lora_B(lora_A(x)) *
s, then a sum, as peft does), autograd makes the low-rank term a fresh [n, out] tensor, scales it
in another pass and adds it to y in a third; in backward it scales the incoming gradient [n, out]
by s in a pass of its own, and adds A's input gradient [n, in] to W's in one more. Here the scale
goes on the [n, r] tensors (r is 8-64: the passes cost nothing), the low-rank term accumulates into
y inside its GEMM (addmm_, beta 1), and A's input gradient into W's the same way. The GEMMs are the
same ones, in the same number; only the sums' rounding order differs (fp32: about 1e-7 relative).

Frozen W (the LoRA case) gets no weight gradient; a W or bias that trains (a caller's choice) gets
its gradient as F.linear's would be.
"""
from __future__ import annotations

import torch


class _LoraProduct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, x_lora, weight, bias, lora_a, lora_b, scaling: float):
        # x: [n, in]; x_lora: x after LoRA's dropout [n, in], or None (no dropout: x itself)
        low = ((x if x_lora is None else x_lora) @ lora_a.t()).mul_(scaling)   # [n, r]: s A x_l
        y = x @ weight.t() if bias is None else torch.addmm(bias, x, weight.t())   # [n, out]
        y.addmm_(low, lora_b.t())                                           # + s B A x_l, in the GEMM
        ctx.save_for_backward(x, x_lora, low, weight, lora_a, lora_b)
        ctx.scaling, ctx.has_bias = scaling, bias is not None
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, x_lora, low, weight, lora_a, lora_b = ctx.saved_tensors
        need_x, need_xl, need_w, need_b, need_a, need_bb, _ = ctx.needs_input_grad
        g = grad_y                                                          # [n, out]
        g_low = (g @ lora_b).mul_(ctx.scaling)                              # [n, r]: s (dL/dy) B
        grad_x = grad_xl = grad_w = grad_bias = grad_a = grad_b = None
        if need_x:
            grad_x = g @ weight                                             # [n, in]
            if x_lora is None:                                              # A's input is x: one sum
                grad_x.addmm_(g_low, lora_a)
        if need_xl and x_lora is not None:
            grad_xl = g_low @ lora_a
        if need_a:
            grad_a = g_low.t() @ (x if x_lora is None else x_lora)         # [r, in]
        if need_bb:
            grad_b = g.t() @ low                                            # [out, r]: low is s A x_l
        if need_w:
            grad_w = g.t() @ x
        if need_b and ctx.has_bias:
            grad_bias = g.sum(0)
        return grad_x, grad_xl, grad_w, grad_bias, grad_a, grad_b, None


def lora_product(x, x_lora, weight, bias, lora_a, lora_b, scaling: float):
    """x W^T + bias + scaling * (x_lora A^T) B^T, x_lora None meaning x. Shapes as above; the
    output is [..., out]."""
    flat = x.reshape(-1, x.shape[-1])                                       # [n, in]
    flat_lora = None if x_lora is None else x_lora.reshape(flat.shape)
    y = _LoraProduct.apply(flat, flat_lora, weight, bias, lora_a, lora_b, scaling)   # [n, out]
    return y.view(*x.shape[:-1], y.shape[-1])
