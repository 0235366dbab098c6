"""The causal-LM heads' summed token cross-entropy (galaxy.layers.token_loss) against torch's
F.cross_entropy in float64: the loss and the gradient, with ignored rows, in one block of rows and
in many (blocks that split the rows unevenly, and one row per block)."""
import pytest
import torch
import torch.nn.functional as F

from galaxy.layers import token_loss
from galaxy.layers.token_loss import summed_token_cross_entropy


@pytest.mark.parametrize("block", [1 << 20, 7 * 50, 50], ids=["one-block", "7-rows", "1-row"])
def test_matches_torch_cross_entropy_in_float64(monkeypatch, block):
    monkeypatch.setattr(token_loss, "BLOCK_ELEMENTS", block)
    g = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(37, 50, generator=g)).requires_grad_()      # [n, V]
    targets = torch.randint(0, 50, (37,), generator=g)
    targets[::4] = -100                                                   # ignored rows
    reference = logits.detach().double().requires_grad_()
    expected = F.cross_entropy(reference, targets, ignore_index=-100, reduction="sum")
    (0.37 * expected).backward()
    loss = summed_token_cross_entropy(logits, targets)
    (0.37 * loss).backward()
    assert abs(loss.item() - expected.item()) <= 1e-6 * expected.item()
    assert (logits.grad.double() - reference.grad).abs().max() <= 1e-6 * reference.grad.abs().max()
    assert torch.all(logits.grad[::4] == 0)                               # ignored rows: no gradient
    with torch.no_grad():                                                 # no gradient kept: same loss
        assert summed_token_cross_entropy(logits, targets).item() == loss.item()
