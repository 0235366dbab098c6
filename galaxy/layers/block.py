"""The block composer: ATT -> CON1 -> MLP -> CON2 with a Transition at every boundary.

The residual stream lives in the layout of the CONs (R or S). Each CON returns two tensors:
the residual stream and the input of the next sub-block. Post-norm (BERT) returns the same
tensor twice; pre-norm (Llama) returns the running sum and its normalised copy.
Transitions are identities until a plan sets them (serial training never pays for them).
"""
from __future__ import annotations

from torch import nn

from galaxy.distributed.transitions import Transition


class TransformerBlock(nn.Module):
    def __init__(self, att: nn.Module, con1: nn.Module, mlp: nn.Module, con2: nn.Module):
        super().__init__()
        self.att, self.con1, self.mlp, self.con2 = att, con1, mlp, con2
        self.to_att = Transition()     # CON layout -> ATT input layout
        self.from_att = Transition()   # ATT output layout -> CON layout
        self.to_mlp = Transition()
        self.from_mlp = Transition()

    def forward(self, stream, x, **att_kwargs):
        # stream, x: [b, s_con, h] in the CON layout (s_con = full or local sequence)
        out, bias = self.att(self.to_att(x), **att_kwargs)
        stream, x = self.con1(self.from_att(out), bias, stream)
        out, bias = self.mlp(self.to_mlp(x))
        return self.con2(self.from_mlp(out), bias, stream)
