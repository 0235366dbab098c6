"""SP attention in blocks (galaxy.layers.attention_blocks): the own keys attended while the K/V
gather travels, the other ranks' blocks after, merged by log-sum-exp.

One process, float64, against scaled_dot_product_attention over the whole sequence: the output
and the gradients of q, of the own K/V and of the gathered K/V (what the backward reduce-scatter
sends to the other ranks), with the own block first, in the middle and last; GQA, a causal mask,
and left-padded rows that see no key (zeros, no gradient, as from scaled_dot_product_attention).
The order of kernel calls shows the overlap: forward attends to the own block before it waits
for the gather; backward reaches the gathered K/V's gradient (where the reduce-scatter starts)
before the own block's backward. The distributed parity of SP plans against Hugging Face
(test_parity_bert, test_parity_llama: the world-3 plans with an SP ATT set kv_blocks) runs through
the same path.
"""
import pytest
import torch

from galaxy.layers import attention_blocks
from galaxy.layers.attention import attention, attention_while_gathering

B, S, HEADS, D = 2, 9, 4, 8


class GatherStandIn:
    """Plays KVGather for one rank: the other ranks' K/V are leaves, so their gradients are what
    the reduce-scatter would send back."""

    def __init__(self, before, after, events):
        self.before, self.after, self.events = before, after, events

    def start(self, x):
        def finish():
            self.events.append("wait")
            gathered = torch.cat((self.before, x, self.after), dim=1)
            if gathered.requires_grad:
                gathered.register_hook(lambda g: self.events.append("gathered grad"))
            return gathered
        return finish

    def own(self, tokens):
        return slice(self.before.shape[1], self.before.shape[1] + tokens)


def _recording(monkeypatch, events):
    fwd, bwd = attention_blocks._forward_cpu, attention_blocks._backward_cpu

    def forward(q, k, *a, **kw):
        events.append(("forward", k.shape[2]))
        return fwd(q, k, *a, **kw)

    def backward(g, q, k, *a, **kw):
        events.append(("backward", k.shape[2]))
        return bwd(g, q, k, *a, **kw)
    monkeypatch.setattr(attention_blocks, "_forward_cpu", forward)
    monkeypatch.setattr(attention_blocks, "_backward_cpu", backward)


@pytest.mark.parametrize("own", [(0, 4), (4, 9), (3, 7)])   # block lengths differ: the events tell them apart
@pytest.mark.parametrize("kv_heads,causal", [(4, False), (2, True)])
def test_blocks_match_whole_sequence_attention(monkeypatch, own, kv_heads, causal):
    gen = torch.Generator().manual_seed(sum(own) + kv_heads)
    q, k, v = (torch.randn(B, S, n, D, generator=gen, dtype=torch.float64) for n in (HEADS, kv_heads, kv_heads))
    keys = torch.ones(B, S, dtype=torch.bool)
    keys[0, :2] = False                                   # sequence 0 left-padded by 2
    mask = keys[:, None, None, :].expand(B, 1, S, S)
    if causal:                                            # rows 0, 1 of sequence 0 see no key
        mask = mask & torch.ones(S, S, dtype=torch.bool).tril()
    rows = slice(*own)
    grad_out = torch.randn(B, own[1] - own[0], HEADS * D, generator=gen, dtype=torch.float64)

    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = attention(ref[0][:, rows], ref[1], ref[2], mask[:, :, rows], dropout_p=0.0, enable_gqa=kv_heads < HEADS)
    expected.backward(grad_out)

    events = []
    _recording(monkeypatch, events)
    qr, kr, vr = (t[:, rows].clone().requires_grad_() for t in (q, k, v))
    kv = torch.cat((k, v), dim=2).flatten(2)
    before, after = (kv[:, :own[0]].clone().requires_grad_(), kv[:, own[1]:].clone().requires_grad_())
    got = attention_while_gathering(lambda: qr, kr, vr, GatherStandIn(before, after, events), mask[:, :, rows],
                                    dropout_p=0.0, enable_gqa=kv_heads < HEADS, blocks=True)
    got.backward(grad_out)

    assert torch.allclose(got, expected, rtol=0, atol=1e-12)
    assert torch.allclose(qr.grad, ref[0].grad[:, rows], rtol=0, atol=1e-12)
    # Own K/V: the own block's gradient here plus the gathered copy's (other ranks' queries would
    # add theirs in the reduce-scatter; this rank's queries reach the own keys only once).
    assert torch.allclose(kr.grad, ref[1].grad[:, rows], rtol=0, atol=1e-12)
    assert torch.allclose(vr.grad, ref[2].grad[:, rows], rtol=0, atol=1e-12)
    others = torch.cat((ref[1].grad, ref[2].grad), dim=2).flatten(2)
    for part, span in ((before, slice(0, own[0])), (after, slice(own[1], S))):
        assert torch.allclose(part.grad, others[:, span], rtol=0, atol=1e-12)

    own_len, remote = own[1] - own[0], [n for n in (own[0], S - own[1]) if n]
    assert events[:2] == [("forward", own_len), "wait"]
    assert events[2:2 + len(remote)] == [("forward", n) for n in remote]
    backward = events[2 + len(remote):]
    assert backward.index("gathered grad") < backward.index(("backward", own_len))
    assert sorted(e for e in backward if e != "gathered grad") == sorted(("backward", n) for n in [own_len, *remote])


@pytest.mark.parametrize("blocks,dropout_p", [(False, 0.0), (True, 0.5)])
def test_without_blocks_or_with_dropout_attends_once_after_the_gather(monkeypatch, blocks, dropout_p):
    """kv_blocks off (the default), or dropout (the fused kernel draws none): the context comes
    from one scaled_dot_product_attention over the gathered keys, and no block kernel runs."""
    events = []
    _recording(monkeypatch, events)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, 4, HEADS, D, generator=gen) for _ in range(3))
    after = torch.randn(B, S - 4, 2 * HEADS * D, generator=gen)
    out = attention_while_gathering(lambda: q, k, v, GatherStandIn(after[:, :0], after, events), None,
                                    dropout_p=dropout_p, blocks=blocks)
    k_all, v_all = torch.cat((torch.cat((k, v), dim=2).flatten(2), after), dim=1).unflatten(-1, (2 * HEADS, D)).chunk(2, 2)
    if dropout_p == 0.0:
        assert torch.allclose(out, attention(q, k_all, v_all, None, dropout_p=0.0), rtol=0, atol=1e-6)
    assert out.shape == (B, 4, HEADS * D)
    assert events == ["wait"]
    assert attention_blocks.split_attention_available(q, 0.0)
    assert not attention_blocks.split_attention_available(q, 0.5)


def test_bf16_blocks_keep_the_dtype_and_match_whole_attention():
    """Under mixed_precision bf16 the projections are bf16: the blocks return bf16, merged in
    fp32 (the kernel's log-sum-exp is fp32), as close to the fp32 result as one bf16 call is."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(B, 4, HEADS, D, generator=gen) for _ in range(3))
    after = torch.randn(B, S - 4, 2 * HEADS * D, generator=gen)
    k_all, v_all = torch.cat((torch.cat((k, v), dim=2).flatten(2), after), dim=1).unflatten(-1, (2 * HEADS, D)).chunk(2, 2)
    exact = attention(q, k_all, v_all, None, dropout_p=0.0)
    bf = [t.to(torch.bfloat16).requires_grad_() for t in (q, k, v, after)]
    got = attention_while_gathering(lambda: bf[0], bf[1], bf[2], GatherStandIn(bf[3][:, :0], bf[3], []), None,
                                    dropout_p=0.0, blocks=True)
    once = attention(*(t.to(torch.bfloat16) for t in (q, k_all, v_all)), None, dropout_p=0.0)
    got.float().sum().backward()
    assert got.dtype == torch.bfloat16 and all(t.grad.dtype == torch.bfloat16 for t in bf)
    assert (got.float() - exact).abs().max() <= 1.5 * (once.float() - exact).abs().max() + 1e-3


def test_blocks_under_bf16_autocast_compute_as_sdpa_does():
    """Under autocast the projections and rotary can leave Q, K and V in different dtypes; the
    blocks' kernel (not on autocast's list) refused them. They now run in autocast's dtype, as
    scaled_dot_product_attention does: equal to it within bf16 rounding, gradients included."""
    gen = torch.Generator().manual_seed(7)
    q, k = (torch.randn(B, S, HEADS, D, generator=gen, requires_grad=True) for _ in range(2))
    v = torch.randn(B, S, HEADS, D, generator=gen).bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = attention_blocks.attend_in_blocks(q, [(k[:, :4], v[:, :4], None), (k[:, 4:], v[:, 4:], None)])
        ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                               v.transpose(1, 2)).transpose(1, 2).flatten(2)
    assert ours.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(ours.float(), ref.float(), rtol=2e-2, atol=2e-2)
    grads = torch.autograd.grad(ours.float().square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.float().square().sum(), (q, k, v))
    for g, r in zip(grads, ref_grads):
        assert g.dtype == r.dtype
        torch.testing.assert_close(g.float(), r.float(), rtol=5e-2, atol=5e-2)
