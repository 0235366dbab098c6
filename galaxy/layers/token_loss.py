"""The summed token cross-entropy of a language-model head, computed a block of rows at a time.

    loss = sum over kept rows n of  logsumexp(logits[n]) - logits[n, target[n]]

is F.cross_entropy(logits, targets, ignore_index=..., reduction="sum"), the same numbers to fp32
rounding, for less memory traffic. Torch's composite keeps log_softmax's output [n, vocab] for
backward, then in backward allocates and zero-fills the NLL gradient [n, vocab] and writes
log_softmax's gradient into a third [n, vocab]: three fresh tensors the size of the logits a
step (32 MB each for 1024 tokens of an 8000-word vocabulary, each one new pages the kernel must
fault in and zero on CPU) and four passes over them. Here the forward writes the softmax (the
gradient's only vocabulary-sized part) block by block while the block of logits is in cache, and
saves that instead of log_softmax's output: one tensor of that size in forward, one in backward
(the softmax times the incoming gradient), and no fill. The gradient is exact:
d loss / d logits[n] = softmax(logits[n]) - onehot(target[n]) for kept rows, 0 for ignored ones.
"""
from __future__ import annotations

import torch

# Rows per block on CPU: about 1M logits (4 MB in fp32), so that a block's softmax stays in cache
# between its passes (max, exp, sum, divide); at least one row. An accelerator takes all rows at
# once: there a block costs kernel launches, not cache misses.
BLOCK_ELEMENTS = 1 << 20


def _loss_and_gradient(logits, targets, ignore_index: int, with_gradient: bool):
    """(summed loss, its gradient d loss / d logits [n, V] or None) for logits [n, V] (float) and
    targets [n] (int64; ignore_index: no loss, no gradient)."""
    kept = targets != ignore_index                                         # [n]
    picked = targets.where(kept, 0)[:, None]                               # [n, 1], ignored rows: column 0
    lse = torch.empty(logits.shape[0], dtype=logits.dtype, device=logits.device)   # [n]
    grad = torch.empty_like(logits) if with_gradient else None
    rows = max(1, BLOCK_ELEMENTS // max(1, logits.shape[1]) if logits.device.type == "cpu" else len(logits))
    for start in range(0, logits.shape[0], rows):
        block = slice(start, start + rows)
        lse[block] = _block_softmax(logits[block], None if grad is None else grad[block], kept[block, None])
    loss = ((lse - logits.gather(1, picked).squeeze(1)) * kept).sum()
    if grad is not None:
        # softmax - onehot on kept rows, 0 on ignored ones: the gradient of the summed loss
        grad.scatter_add_(1, picked, -kept[:, None].to(grad.dtype))
    return loss, grad


class _SummedTokenCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, ignore_index: int):
        loss, grad = _loss_and_gradient(logits, targets, ignore_index, with_gradient=True)
        ctx.save_for_backward(grad)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss, None, None


def _block_softmax(x, out, kept):
    """logsumexp of each row of x [rows, V] -> [rows]; with out ([rows, V]), softmax(x) into it,
    rows whose kept [rows, 1] is False zeroed (in the same pass, while the block is in cache)."""
    top = x.amax(-1, keepdim=True)                                         # [rows, 1]
    if out is None:
        return (x - top).exp_().sum(-1).log_().add_(top.squeeze(-1))
    torch.sub(x, top, out=out).exp_()
    total = out.sum(-1, keepdim=True)                                      # [rows, 1]
    out.mul_(kept / total)
    return total.log_().add_(top).squeeze(-1)


def summed_token_cross_entropy(logits, targets, ignore_index: int = -100):
    """logits [n, V] (float), targets [n] -> the summed cross-entropy over rows whose target is not
    ignore_index (a scalar); ignored rows pass no gradient. Without autograd (no_grad, or logits
    that need no gradient) no softmax is written."""
    if torch.is_grad_enabled() and logits.requires_grad:
        return _SummedTokenCrossEntropy.apply(logits, targets, ignore_index)
    return _loss_and_gradient(logits, targets, ignore_index, with_gradient=False)[0]
