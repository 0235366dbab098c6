"""Bottleneck adapters (Houlsby et al. 2019): x + up(act(down(x))) after each sub-block's output.

Every layer gets two, one in each CON (after the attention output and after the MLP output,
before the residual add and the norm), as Houlsby's placement. The up-projection starts at zero,
so at step 0 the adapter adds exact zeros and the model computes the base model's outputs.

An adapter is token-wise and sits in CON, after the sub-block's output has been reduced, so it
runs in the CON layout: on its own tokens under CON SP (its gradients are summed over the group,
rule "sum"), on the full sequence under CON None and serially (rule "replicated").
"""
from __future__ import annotations

from torch import nn

from galaxy.layers.activation import activation
from galaxy.peft.seeding import init_linear, named_generator


class BottleneckAdapter(nn.Module):
    def __init__(self, hidden: int, bottleneck: int, non_linearity: str, std: float,
                 seed: int, name: str, device=None):
        super().__init__()
        self.act = activation(non_linearity, "non_linearity")   # first: an unknown name fails before any weight
        self.down = nn.Linear(hidden, bottleneck, device=device)   # [bottleneck, hidden]
        self.up = nn.Linear(bottleneck, hidden, device=device)     # [hidden, bottleneck], zero
        init_linear(self.down, named_generator(seed, f"{name}.down"), std)
        init_linear(self.up, named_generator(seed, f"{name}.up"), 0.0)

    def forward(self, x):
        # x: [b, s_con, h] -> same shape
        return x + self.up(self.act(self.down(x)))


def add_adapters(model: nn.Module, bottleneck: int, non_linearity: str, seed: int, rule) -> dict:
    """One adapter in every CON of every layer present; returns the new parameters' rules."""
    cfg = model.config
    if not 0 < bottleneck:
        raise ValueError(f"adapter_reduction_dim must be positive, got {bottleneck}")
    std = getattr(cfg, "initializer_range", 0.02)
    device = next(model.parameters()).device
    rules = {}
    for prefix, module in model.named_modules():
        if prefix.startswith("layers.") and prefix.endswith((".con1", ".con2")):
            module.adapter = BottleneckAdapter(cfg.hidden_size, bottleneck, non_linearity, std, seed,
                                               f"{prefix}.adapter", device)
            rules.update({f"{prefix}.adapter.{n}": rule for n, _ in module.adapter.named_parameters()})
    return rules
