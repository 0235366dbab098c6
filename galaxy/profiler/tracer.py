"""Which module a piece of forward and backward work belongs to.

Forward: pre/post hooks on every module keep a call stack; callbacks get (module name, "enter" |
"exit"). Module calls nest, so "work between enter and exit" is the module's inclusive share.

Backward: module-level backward hooks misattribute work (a module that returns its input, one whose
inputs need no grad, or tuple outputs holding a Parameter all break them; torch's ModuleTracker
shows the same). Instead every autograd node is tagged, after the forward, with the innermost
module that created it: walking back from a module's outputs to its inputs, children first. The
engine runs one node at a time per device, so work between a node's pre-hook and hook belongs to
that node's module (exclusive; callers roll it up the tree). What runs outside any node (the
engine summing two gradients for one tensor) belongs to nobody; callers give it to the root.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten


def _nodes(values) -> list:
    flat, _ = tree_flatten(values)
    return [t.grad_fn for t in flat if isinstance(t, torch.Tensor) and t.grad_fn is not None]


class ModuleTracer:
    """Forward call stack and autograd-node ownership for one model.

    on_forward(name, phase) is called with phase "enter" before and "exit" after each module call.
    After `tag_graph()`, on_backward(name, phase) is called with "enter" / "exit" around every
    autograd node that module created, while the backward runs.
    """

    def __init__(self, model: nn.Module, on_forward: Callable | None = None,
                 on_backward: Callable | None = None):
        self.model = model
        self.names = {m: n for n, m in model.named_modules()}
        self.on_forward, self.on_backward = on_forward, on_backward
        self.stack: list[str] = []
        self.called: set[str] = set()
        self._calls: list[tuple[str, set, list]] = []   # (name, input nodes, output nodes), post-order
        self._inputs: list[set] = []
        self._handles = []
        self._node_handles = []

    @property
    def current(self) -> str:
        return self.stack[-1] if self.stack else ""

    def __enter__(self):
        for module, name in self.names.items():
            self._handles.append(module.register_forward_pre_hook(self._pre(name), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post(name), always_call=True))
        return self

    def __exit__(self, *exc):
        for h in self._handles + self._node_handles:
            h.remove()
        self._handles, self._node_handles = [], []

    def _pre(self, name):
        def hook(module, args, kwargs):
            self.stack.append(name)
            self.called.add(name)
            self._inputs.append(set(_nodes((args, kwargs))))
            if self.on_forward:
                self.on_forward(name, "enter")
        return hook

    def _post(self, name):
        def hook(module, args, output):
            if self.on_forward:
                self.on_forward(name, "exit")
            self.stack.pop()
            self._calls.append((name, self._inputs.pop(), _nodes(output)))
        return hook

    def tag_graph(self) -> dict:
        """Tag the nodes of the last forward (children first) and hook them; returns node -> name."""
        owner: dict = {}
        for name, inputs, outputs in self._calls:
            todo, seen = list(outputs), set(inputs)
            while todo:
                node = todo.pop()
                if node is None or node in seen:
                    continue
                seen.add(node)
                owner.setdefault(node, name)
                todo.extend(n for n, _ in node.next_functions)
        self._calls = []
        if self.on_backward:
            for node, name in owner.items():
                self._node_handles.append(node.register_prehook(self._node_pre(name)))
                self._node_handles.append(node.register_hook(self._node_post(name)))
        return owner

    def _node_pre(self, name):
        def hook(grad_outputs):
            self.on_backward(name, "enter")
        return hook

    def _node_post(self, name):
        def hook(grad_inputs, grad_outputs):
            self.on_backward(name, "exit")
        return hook

    def release_graph(self) -> None:
        for h in self._node_handles:
            h.remove()
        self._node_handles = []
