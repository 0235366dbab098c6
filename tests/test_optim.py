"""galaxy.train.optim: training's optimizer takes the fastest step torch supports for its
parameters (fused, else foreach, else the loop), decided by a trial step when it is built, and its
update is torch's default update up to rounding: on plain tensors, and on the DTensors of sharded
data parallelism, where torch 2.13 has a fused AdamW step but no fused SGD step."""
from types import SimpleNamespace

import pytest
import torch

from galaxy.train.optim import build_optimizer, make_optimizer, step_kind

SHAPES = [(300, 64), (64,), (7, 3, 5)]


def _step_both(ours, ref, opt, ref_opt, shapes, gen, wrap=lambda g, p: g):
    for _ in range(3):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        for p, q, g in zip(ours, ref, grads):
            p.grad, q.grad = wrap(g.clone(), p), g.clone()
        opt.step()
        ref_opt.step()


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_fused_step_is_the_default_step(name):
    gen = torch.Generator().manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    cfg = SimpleNamespace(optimizer=name, learning_rate=1e-2, weight_decay=0.01)
    opt = make_optimizer(cfg, ours)
    assert opt.defaults["fused"] is True
    cls = torch.optim.AdamW if name == "adamw" else torch.optim.SGD
    ref_opt = cls(ref, lr=1e-2, weight_decay=0.01, foreach=False)
    _step_both(ours, ref, opt, ref_opt, SHAPES, gen)
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_step_kind_of_plain_tensors():
    assert step_kind("adamw", [torch.nn.Parameter(torch.randn(3))], lr=1e-3) == "fused"
    vector_and_scalar = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(()))]
    assert step_kind("sgd", vector_and_scalar, lr=0.1) == "fused"
    assert step_kind("sgd", [], lr=0.1) == "loop"
    frozen = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    opt = make_optimizer(SimpleNamespace(optimizer="adamw", learning_rate=1e-3, weight_decay=0.0),
                         [frozen, torch.nn.Parameter(torch.randn(2))])
    assert len(opt.param_groups[0]["params"]) == 1       # frozen weights get no state


def _sharded_steps(name: str, plain_shape):
    """Parameters sharded Shard(0) over the 2 ranks (as FSDP2 shards them) plus one plain tensor of
    plain_shape (FSDP leaves 0-d ones whole): the step build_optimizer picks, and its worst error
    after 3 steps against torch's loop on whole plain tensors."""
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh
    mesh = init_device_mesh("cpu", (2,))
    gen = torch.Generator().manual_seed(0)
    shapes = [*SHAPES, plain_shape]
    whole = [torch.randn(s, generator=gen) for s in shapes]
    ours = [torch.nn.Parameter(distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None)) for t in whole[:-1]]
    ours.append(torch.nn.Parameter(whole[-1].clone()))
    ref = [torch.nn.Parameter(t.clone()) for t in whole]
    opt = build_optimizer(name, ours, lr=1e-2, weight_decay=0.01)
    kind = "fused" if opt.defaults.get("fused") else "foreach" if opt.defaults.get("foreach") else "loop"
    ref_opt = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[name](ref, lr=1e-2, weight_decay=0.01, foreach=False)
    def like(g, p):
        return g if p is ours[-1] else distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None)
    _step_both(ours, ref, opt, ref_opt, shapes, gen, like)
    errors = [((p.full_tensor() if p is not ours[-1] else p) - q).abs().max().item() for p, q in zip(ours, ref)]
    return kind, max(errors)


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_step_on_sharded_parameters_is_the_default_step(dist_pool, name):
    """The crash of issue 33: fused SGD on FSDP's DTensors. A 0-d plain tensor among them is a
    replicated scalar to DTensor's fused and foreach ops; a plain vector is refused by both."""
    for plain_shape, kinds in (((), {"adamw": ("fused",), "sgd": ("fused", "foreach")}),
                               ((4,), {"adamw": ("loop",), "sgd": ("loop",)})):
        for kind, error in dist_pool(2).run(_sharded_steps, name, plain_shape):
            assert kind in kinds[name], (plain_shape, kind)
            assert error < 1e-6, (plain_shape, kind, error)
