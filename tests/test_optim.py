"""galaxy.train.optim: training's optimizer is torch's fused kernel where the parameters allow it,
and its update is torch's default update up to rounding."""
from types import SimpleNamespace

import pytest
import torch

from galaxy.train.optim import fused_allowed, make_optimizer


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_fused_step_is_the_default_step(name):
    gen = torch.Generator().manual_seed(0)
    shapes = [(300, 64), (64,), (7, 3, 5)]
    ours = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    cfg = SimpleNamespace(optimizer=name, learning_rate=1e-2, weight_decay=0.01)
    opt = make_optimizer(cfg, ours)
    assert opt.defaults["fused"] is True
    cls = torch.optim.AdamW if name == "adamw" else torch.optim.SGD
    ref_opt = cls(ref, lr=1e-2, weight_decay=0.01, foreach=False)
    for _ in range(3):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        for p, q, g in zip(ours, ref, grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_fused_only_for_floating_point_parameters_on_a_fused_device():
    assert fused_allowed([torch.nn.Parameter(torch.randn(3))])
    assert not fused_allowed([torch.nn.Parameter(torch.randn(3)), torch.zeros(2, dtype=torch.long)])
    assert not fused_allowed([])
    frozen = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    opt = make_optimizer(SimpleNamespace(optimizer="adamw", learning_rate=1e-3, weight_decay=0.0),
                         [frozen, torch.nn.Parameter(torch.randn(2))])
    assert len(opt.param_groups[0]["params"]) == 1       # frozen weights get no state
