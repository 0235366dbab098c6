"""Optimizer from the config: sgd or adamw, torch's defaults except where the config speaks."""
from __future__ import annotations

import torch


def make_optimizer(cfg, params) -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad]   # frozen weights get no optimizer state
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
