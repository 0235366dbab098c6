"""RMSNorm (Zhang and Sennrich 2019), as Hugging Face's LlamaRMSNorm computes it:

    y = w * (x / sqrt(mean(x^2) + eps))        x [..., h], w [h]; in fp32, cast back before w

On fp32 input the forward and backward are one autograd function over x [n, h] and the row
factor r = rsqrt(mean(x^2) + eps) [n, 1]. The forward is Hugging Face's, operator for operator
(the same bits). Composed of elementwise operators, autograd's backward writes one tensor of x's
size for each operator it passes back through (the weight's product, the row scaling, the mean's
expansion, the square's derivative) plus the sum of two of them: about seven passes over [n, h].
Written out,

    dL/dx = r (g w) - x r^3 mean((g w) x)

is three: g w, its dot product with x row by row, and one multiply-add; the weight's gradient,
sum over rows of g x r, only when the weight trains (not under LoRA). The same to fp32
rounding. Other dtypes (bf16 autocast's inputs) take the composed form, where the casts are.
"""
from __future__ import annotations

import torch
from torch import nn


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps: float):
        # x [n, h] (fp32), weight [h]
        # the row factor as Hugging Face computes it, bit for bit (a tiny model's attention
        # amplifies a last-bit difference here to 1e-5 in its logits)
        r = x.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()           # [n, 1]
        ctx.save_for_backward(x, weight, r)                              # r [n, 1]
        return torch.mul(x, r).mul_(weight)

    @staticmethod
    def backward(ctx, g):
        x, weight, r = ctx.saved_tensors
        need_x, need_w, _ = ctx.needs_input_grad
        grad_x = grad_w = None
        if need_w:
            grad_w = (g * x).mul_(r).sum(0)                              # [h]
        if need_x:
            gw = g * weight                                              # [n, h]
            dot = torch.linalg.vecdot(gw, x).unsqueeze(-1)               # [n, 1]: sum_h (g w) x
            coef = r.square().mul_(dot).div_(-x.shape[-1])               # [n, 1]: -r^2 mean((g w) x)
            grad_x = torch.addcmul(gw, x, coef).mul_(r)                  # r (g w - x r^2 mean(...))
        return grad_x, grad_w, None


class RMSNorm(nn.Module):
    """Normalises in fp32 and casts back before the weight, as Hugging Face's LlamaRMSNorm."""

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x):
        # x [..., h]
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            y = _RMSNormFunction.apply(x.reshape(-1, x.shape[-1]), self.weight, self.eps)   # [n, h]
            return y.view(x.shape)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
