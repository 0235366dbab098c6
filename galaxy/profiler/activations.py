"""Activation memory: bytes of the tensors autograd saves for the backward, per module.

A saved tensor is charged to the innermost module running when it is saved, once per storage
(a view and its base, or one tensor saved by two ops, are one allocation). Storages of parameters
(a weight saved for dX = dY W) are not activations and are skipped.
"""
from __future__ import annotations

from collections import Counter

import torch
from torch import nn


class SavedActivations:
    def __init__(self, model: nn.Module, current_module):
        self.current_module = current_module            # () -> name of the running module
        self.bytes: Counter = Counter()                 # module name -> bytes (exclusive)
        self._skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._seen: set = set()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = (t.device, storage.data_ptr())
        if storage.data_ptr() not in self._skip and key not in self._seen:
            self._seen.add(key)
            self.bytes[self.current_module()] += storage.nbytes()
        return t

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
