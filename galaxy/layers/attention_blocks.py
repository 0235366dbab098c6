"""Attention over blocks of keys, merged by their log-sum-exp: how an SP ATT attends to its own
tokens' keys while the other ranks' K/V are still being gathered.

For query rows q and a partition of the keys into blocks i (the rank's own tokens, the ranks
before it, the ranks after it):

    o_i = softmax(q K_i^T scale + mask_i) V_i      lse_i = logsumexp of block i's scores
    lse = logaddexp over i of lse_i                 o = sum_i exp(lse_i - lse) o_i

equals attention over every key. Backward needs only the merged o and lse (the identity flash
attention's backward rests on): with P_i = exp(S_i - lse), block i's columns of the full softmax,
dV_i = P_i^T dO, dS_i = P_i * (dO V_i^T - rowsum(dO * o)), dQ += dS_i K_i scale, dK_i = dS_i^T q scale.
So each block is an autograd node of its own, and in backward the own block runs while the
gradient of the others' K/V is reduce-scattered (galaxy.distributed.overlap), as in forward it
runs while their K/V are all-gathered.

A block is one call of the fused kernel that returns the log-sum-exp beside the output. PyTorch
has one for CPU tensors (the one its scaled_dot_product_attention uses there); without dropout on
a CPU tensor `split_attention_available` says yes, and callers otherwise attend once over the
gathered keys (galaxy.layers.attention), after the whole gather. The config key kv_blocks turns the
blocks on: on this project's 2-core VM over loopback they cost 2.5% of an SP step (the block calls
and the merge, with no idle core to hide the gather behind), over a 1 Gbit/s link they saved 2.2%
(bench/README.md, overlap_paired.py).
"""
from __future__ import annotations

import torch

_forward_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_backward_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def split_attention_available(q: torch.Tensor, dropout_p: float) -> bool:
    """Whether attend_in_blocks can run: the kernel exists for q's device and needs no dropout
    (the fused CPU kernel draws none)."""
    return q.device.type == "cpu" and dropout_p == 0.0 and q.dtype in (torch.float32, torch.float64,
                                                                         torch.bfloat16, torch.float16)


def additive_mask(mask: torch.Tensor | None, dtype) -> torch.Tensor | None:
    """bool mask (True = attend) -> 0 / the dtype's lowest finite value, the form the kernel takes.
    Finite, not -inf: a row with no visible key in one block then gets lse ~ lowest and weight 0
    in the merge, where -inf would give the kernel's lse 0 for it."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


class Merged:
    """The merged output and log-sum-exp, shared by the blocks' backward nodes."""
    out: torch.Tensor
    lse: torch.Tensor


class _Block(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, scale, merged):
        # q: [b, heads, s, d]; k, v: [b, kv_heads, S_i, d]; mask: bool, broadcastable to
        # [b, heads, s, S_i], or None -> o_i [b, heads, s, d], lse_i [b, heads, s]. The bool mask
        # is what backward keeps (a view of the layer's): its additive form is 4x the bytes.
        out, lse = _forward_cpu(q, k, v, 0.0, False, attn_mask=additive_mask(mask, q.dtype), scale=scale)
        ctx.save_for_backward(q, k, v)
        ctx.mask, ctx.scale, ctx.merged = mask, scale, merged
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _):
        # grad_out is the merged output's gradient (_Merge passes it on unweighted).
        q, k, v = ctx.saved_tensors
        m = ctx.merged
        dq, dk, dv = _backward_cpu(grad_out, q, k, v, m.out, m.lse, 0.0, False,
                                   attn_mask=additive_mask(ctx.mask, q.dtype), scale=ctx.scale)
        return dq, dk, dv, None, None, None


class _Merge(torch.autograd.Function):
    @staticmethod
    def forward(ctx, merged, *blocks):
        # blocks: o_1, lse_1, o_2, lse_2, ... as _Block returns them
        outs, lses = blocks[0::2], blocks[1::2]
        lse = lses[0]
        for other in lses[1:]:
            lse = torch.logaddexp(lse, other)
        # The kernel's lse is fp32 for bf16 / fp16 blocks: the sum runs in lse's dtype and the
        # merged output takes the blocks' dtype, as the backward kernel wants it beside q.
        out = sum(torch.exp(part - lse).unsqueeze(-1) * o.to(lse.dtype) for o, part in zip(outs, lses))
        out = out.to(outs[0].dtype)
        merged.out, merged.lse = out, lse
        ctx.blocks = len(outs)
        return out

    @staticmethod
    def backward(ctx, grad):
        return (None,) + (grad, None) * ctx.blocks


def _as_sdpa_would(t: torch.Tensor) -> torch.Tensor:
    """t in the dtype scaled_dot_product_attention computes in: autocast's where autocast is on
    for t's device (it casts SDPA's inputs to it). The blocks' kernel is not on autocast's list,
    so it saw Q, K and V as the projections and rotary left them, of mixed dtypes under bf16,
    and refused them (kv_blocks with bf16 died on the first step)."""
    device = t.device.type
    return t.to(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else t


def attend_in_blocks(q: torch.Tensor, blocks, scale=None) -> torch.Tensor:
    """q [b, s, heads, d]; blocks: [(k_i, v_i, bool mask_i or None)], k_i and v_i
    [b, S_i, kv_heads, d] -> context [b, s, heads*d]. Blocks may be appended to lazily (a
    generator): each one is computed as it is drawn."""
    merged, pieces = Merged(), []
    qt = _as_sdpa_would(q).transpose(1, 2)                                # [b, heads, s, d]
    for k, v, mask in blocks:
        k, v = _as_sdpa_would(k), _as_sdpa_would(v)
        pieces.extend(_Block.apply(qt, k.transpose(1, 2), v.transpose(1, 2), mask, scale, merged))
    out = _Merge.apply(merged, *pieces)                                 # [b, heads, s, d]
    return out.transpose(1, 2).flatten(2)
