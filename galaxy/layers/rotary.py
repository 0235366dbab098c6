"""Rotary position embedding (Su et al. 2021) as Hugging Face's Llama applies it to queries and keys:

    y = t cos + rotate_half(t) sin        rotate_half(t) = [-t2, t1]  (t = [t1, t2], halves of d)

t [b, s, heads, d]; cos, sin [b, s, 1, d] (the layer context's tables, broadcast over the heads).
Composed of operators, autograd runs five passes over t forward (t cos, the halves' negation and
concatenation, the product with sin, the sum) and as many back. By halves it is

    y1 = t1 cos1 - t2 sin1        y2 = t2 cos2 + t1 sin2
    dt1 = g1 cos1 + g2 sin2       dt2 = g2 cos2 - g1 sin1

four half-size products and two half-size sums each way, about three passes where the composed form
runs five, each product rounded as the composed form rounds it (a - b and a + (-b) are the same
number): the same bits. Other dtypes than fp32 (autocast's bf16 projections beside fp32
tables) take the composed form, where the promotion is.
"""
from __future__ import annotations

import torch


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _halves(t, cos, sin):
    # (y, and the halves of y, t, cos, sin); y takes the broadcast shape, as t * cos would
    half = t.shape[-1] // 2
    y = torch.empty(torch.broadcast_shapes(t.shape, cos.shape), dtype=t.dtype, device=t.device)
    return y, *((x[..., :half], x[..., half:]) for x in (y, t, cos, sin))


class _Rotary(torch.autograd.Function):
    # Products and sums apart, not addcmul: its fused multiply-add rounds once where the
    # composed form rounds twice. Each half is [b, s, heads, d/2].
    @staticmethod
    def forward(ctx, t, cos, sin):
        y, (y1, y2), (t1, t2), (c1, c2), (s1, s2) = _halves(t, cos, sin)
        torch.mul(t1, c1, out=y1).sub_(torch.mul(t2, s1))              # t1 cos1 - t2 sin1
        torch.mul(t2, c2, out=y2).add_(torch.mul(t1, s2))              # t2 cos2 + t1 sin2
        ctx.save_for_backward(cos, sin)
        return y

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        dt, (d1, d2), (g1, g2), (c1, c2), (s1, s2) = _halves(g, cos, sin)
        torch.mul(g1, c1, out=d1).add_(torch.mul(g2, s2))              # g1 cos1 + g2 sin2
        torch.mul(g2, c2, out=d2).sub_(torch.mul(g1, s1))              # g2 cos2 - g1 sin1
        return dt, None, None


def apply_rotary(t, cos, sin):
    """t [b, s, heads, d] rotated by cos, sin [b, s, 1, d]: t cos + rotate_half(t) sin."""
    if t.dtype == cos.dtype == sin.dtype == torch.float32 and not (cos.requires_grad or sin.requires_grad):
        return _Rotary.apply(t, cos, sin)
    return t * cos + rotate_half(t) * sin


def rotary(t, context: dict):
    """Queries or keys t [b, s, heads, d] rotated by the context's cos, sin [b, s, 1, d] (the
    layer_context's tables, at t's positions)."""
    return apply_rotary(t, context["cos"], context["sin"])
