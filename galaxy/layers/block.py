"""The block composer: ATT -> CON1 -> MLP -> CON2 with a Transition at every boundary.

The residual stream lives in the layout of the CONs (R or S). Each CON returns two tensors:
the residual stream and the input of the next sub-block. Post-norm (BERT) returns the same
tensor twice; pre-norm (Llama) returns the running sum and its normalised copy.
Transitions are identities until a plan sets them (serial training never pays for them).
"""
from __future__ import annotations

import torch
from torch import nn

from galaxy.distributed.transitions import Transition
from galaxy.layers.recompute import run_checkpointed


class TransformerBlock(nn.Module):
    def __init__(self, att: nn.Module, con1: nn.Module, mlp: nn.Module, con2: nn.Module):
        super().__init__()
        self.att, self.con1, self.mlp, self.con2 = att, con1, mlp, con2
        self.to_att = Transition()     # CON layout -> ATT input layout
        self.from_att = Transition()   # ATT output layout -> CON layout
        self.to_mlp = Transition()
        self.from_mlp = Transition()
        # Activation checkpointing (set_recompute): recompute this block in backward.
        self.recompute, self.recompute_rng = False, None

    def set_recompute(self, on: bool, rng=None) -> None:
        """Keep only this block's inputs for backward and recompute the rest (galaxy.layers.
        recompute); rng: the sharded dropout stream its sub-blocks draw from, if any."""
        self.recompute, self.recompute_rng = on, rng

    def forward(self, stream, x, **att_kwargs):
        # stream, x: [b, s_con, h] in the CON layout (s_con = full or local sequence)
        if self.recompute and torch.is_grad_enabled():
            return run_checkpointed(self._forward, stream, x, rng=self.recompute_rng, **att_kwargs)
        return self._forward(stream, x, **att_kwargs)

    def _forward(self, stream, x, **att_kwargs):
        out, bias = self.att(self.to_att(x), **att_kwargs)
        stream, x = self.con1(self.from_att(out), bias, stream)
        out, bias = self.mlp(self.to_mlp(x))
        return self.con2(self.from_mlp(out), bias, stream)
