"""Optimizer from the config: sgd or adamw, torch's defaults except where the config speaks, and
the fastest of torch's three step implementations that torch supports for these parameters.

Why fused: torch's default AdamW on CPU is the one-tensor-at-a-time loop, which allocates fresh
temporaries per tensor (sqrt(v), then the division); a vocabulary table's are tens of MB each, and
on CPU every fresh mapping is paid in page faults. all-MiniLM-L6-v2's step took 148 ms that way,
17 ms fused (one thread), the same update up to rounding. CUDA defaults to foreach; fused is one
kernel per tensor group there too.

Why a trial step decides it: what torch supports depends on the optimizer, the tensor kind and the
device together, and changes between releases. Under sharded data parallelism every parameter is
a DTensor, and DTensor runs an op only if it has a sharding strategy for it: torch 2.13 registers
one for `_fused_adamw_` but none for `_fused_sgd_` (the fused SGD step raised NotImplementedError
on the first step, after the process group had started); a list that mixes DTensors with plain
tensors (FSDP leaves 0-d parameters whole) is refused by the fused and foreach ops unless the plain
ones are 0-d. Rather than keep a table of such facts, `step_kind` asks torch, once, when the
optimizer is built.
"""
from __future__ import annotations

import torch

from galaxy.parallel.dtensors import dtensor_class, is_dtensor, local

OPTIMIZERS = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}
# Fastest first; each is the keyword torch's optimizers take for it. The loop (one tensor at a
# time, plain aten ops) runs on every tensor kind DTensor can hold.
STEP_KINDS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "loop": {"foreach": False}}
STEP_FLAGS = ("fused", "foreach")     # the parameter-group keys that hold the choice


def _signature(p: torch.Tensor) -> tuple:
    """What decides which step kernels apply to p: its tensor kind (and, for a DTensor, its mesh and
    placements), device, dtype, number of dimensions and whether it holds one element (DTensor
    takes a plain one-element tensor in its lists as a replicated scalar, any other plain tensor
    as an error)."""
    sharding = (p.device_mesh, tuple(p.placements)) if is_dtensor(p) else None
    return sharding, p.device, p.dtype, p.dim(), p.numel() == 1


def _stand_in(signature: tuple, value: float) -> torch.Tensor:
    """A throwaway tensor of that signature, one or two elements per rank (no communication: a
    DTensor is built from this rank's local part without checking the other ranks')."""
    sharding, device, dtype, ndim, single = signature
    shape = (1 if single or i else 2 for i in range(max(ndim, sharding is not None)))
    part = torch.full(tuple(shape), value, device=device, dtype=dtype)
    return part if sharding is None else dtensor_class().from_local(part, *sharding, run_check=False)


def _trial(name: str, signatures: list[tuple], kind: str, hyper: dict) -> list[torch.Tensor]:
    """Two steps of `kind` on stand-ins of the signatures: their values after (this rank's parts)."""
    params = [torch.nn.Parameter(_stand_in(s, 0.5 + i)) for i, s in enumerate(signatures)]
    opt = OPTIMIZERS[name](params, **hyper, **STEP_KINDS[kind])
    for step in range(2):
        for i, p in enumerate(params):
            p.grad = torch.full_like(p, 0.25 * (i + 1) * (step + 1))
        opt.step()
    return [local(p.detach()) for p in params]


def step_kind(name: str, params, **hyper) -> str:
    """The fastest of STEP_KINDS whose trial steps run on stand-ins of `params` and agree with the
    loop's (up to rounding; a kind torch refuses raises a RuntimeError, NotImplementedError among
    them). Deterministic: every rank holding the same kinds of tensors decides the same. Cheap:
    a few one-element tensors, no communication. hyper: the optimizer's keywords (lr, ...)."""
    signatures = list(dict.fromkeys(_signature(p) for p in params))
    if not signatures:
        return "loop"
    reference = _trial(name, signatures, "loop", hyper)
    for kind in ("fused", "foreach"):
        try:
            values = _trial(name, signatures, kind, hyper)
        except RuntimeError:
            continue
        if all(torch.allclose(v, r, rtol=1e-6, atol=0) for v, r in zip(values, reference)):
            return kind
    return "loop"


def build_optimizer(name: str, params, lr: float, weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """`name` ("adamw" | "sgd") over the trainable ones of params, as training builds it, with the
    step step_kind picks for them."""
    params = [p for p in params if p.requires_grad]   # frozen weights get no optimizer state
    hyper = {"lr": lr, "weight_decay": weight_decay}
    # A pipeline stage may train nothing (LoRA targets in other stages' layers): one empty group
    # keeps step, schedules and the checkpointed state working (torch refuses an empty list).
    groups = params or [{"params": []}]
    return OPTIMIZERS[name](groups, **hyper, **STEP_KINDS[step_kind(name, params, **hyper)])


def make_optimizer(cfg, params) -> torch.optim.Optimizer:
    return build_optimizer(cfg.optimizer, params, cfg.learning_rate, cfg.weight_decay)
