"""Optimizer from the config: sgd or adamw, torch's defaults except where the config speaks, and
torch's fused kernels wherever every parameter allows them.

Why fused: torch's default AdamW on CPU is the one-tensor-at-a-time loop, which allocates fresh
temporaries per tensor (sqrt(v), then the division); a vocabulary table's are tens of MB each, and
on CPU every fresh mapping is paid in page faults. all-MiniLM-L6-v2's step took 148 ms that way,
17 ms fused (one thread), the same update up to rounding. CUDA defaults to foreach; fused is one
kernel per tensor group there too.
"""
from __future__ import annotations

import torch
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices


def fused_allowed(params: list[torch.Tensor]) -> bool:
    """torch's fused kernels take floating-point parameters on one of their devices: all plain
    tensors, or all DTensors (sharded data parallelism shards every parameter; a DTensor is judged
    by its local shard). A mix (torch's own tensor parallelism leaves embeddings and norms plain)
    is refused by the fused kernel, so it gets torch's default."""
    from torch.distributed.tensor import DTensor
    devices = set(_get_fused_kernels_supported_devices())
    if not params or len({isinstance(p, DTensor) for p in params}) > 1:
        return False
    locals_ = [p.to_local() if isinstance(p, DTensor) else p for p in params]
    return all(torch.is_floating_point(t) and t.device.type in devices for t in locals_)


def build_optimizer(name: str, params, lr: float, weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """`name` ("adamw" | "sgd") over the trainable ones of params, as training builds it."""
    params = [p for p in params if p.requires_grad]   # frozen weights get no optimizer state
    fused = {"fused": True} if fused_allowed(params) else {}
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay, **fused)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, **fused)


def make_optimizer(cfg, params) -> torch.optim.Optimizer:
    return build_optimizer(cfg.optimizer, params, cfg.learning_rate, cfg.weight_decay)
