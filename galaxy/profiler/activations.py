"""Activation memory: bytes of the tensors autograd saves for the backward, per module.

A saved tensor is charged to the innermost module running when it is saved, once per storage
(a view and its base, or one tensor saved by two ops, are one allocation). Storages of parameters
(a weight saved for dX = dY W) are not activations and are skipped.

Activation checkpointing: a recomputed layer (a module whose `recompute` is set,
galaxy.layers.block.TransformerBlock) saves nothing through these hooks (torch's checkpoint
intercepts its saves) but keeps its inputs alive for the recomputation: those are charged to the
layer, once per storage like every saved tensor.
"""
from __future__ import annotations

from collections import Counter
from functools import partial

import torch
from torch import nn


class SavedActivations:
    def __init__(self, model: nn.Module, current_module):
        self.current_module = current_module            # () -> name of the running module
        self.bytes: Counter = Counter()                 # module name -> bytes (exclusive)
        self._skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._seen: set = set()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._recomputed = [(name, m) for name, m in model.named_modules() if getattr(m, "recompute", False)]
        self._input_hooks: list = []

    def _charge(self, t: torch.Tensor, module: str) -> None:
        storage = t.untyped_storage()
        key = (t.device, storage.data_ptr())
        if storage.data_ptr() not in self._skip and key not in self._seen:
            self._seen.add(key)
            self.bytes[module] += storage.nbytes()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._charge(t, self.current_module())
        return t

    def _keep_inputs(self, name: str, module, args, kwargs) -> None:
        if torch.is_grad_enabled():          # a recomputed layer keeps its inputs for backward
            for t in (*args, *kwargs.values()):
                if isinstance(t, torch.Tensor):
                    self._charge(t, name)

    def __enter__(self):
        self._hooks.__enter__()
        self._input_hooks = [m.register_forward_pre_hook(partial(self._keep_inputs, name), with_kwargs=True)
                             for name, m in self._recomputed]
        return self

    def __exit__(self, *exc):
        for h in self._input_hooks:
            h.remove()
        self._hooks.__exit__(*exc)
