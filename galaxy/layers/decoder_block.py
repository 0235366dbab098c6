"""The decoder layer of an encoder-decoder: ATT -> CON1 -> XATT -> CONX -> MLP -> CON2.

TransformerBlock with one more sub-block, cross-attention (galaxy.layers.cross_attention), and
the CON after it; every boundary has its Transition, set by the plan like the others. The
decoder's CON layout splits the decoder's own tokens (`sequence = "target"`: apply_plan gives
its transitions the group's decoder shares), so source and target may be split differently.

    forward(stream, x, memory=..., cross={...}, **att_kwargs)

memory: the encoder's output [b, S_src, h], whole on every rank; cross: XATT's layer context
(the encoder's padding mask); att_kwargs: the decoder's self-attention context (causal mask).
"""
from __future__ import annotations

from torch import nn

from galaxy.distributed.transitions import Transition
from galaxy.layers.block import TransformerBlock, cross


class DecoderBlock(TransformerBlock):
    sequence = "target"

    def __init__(self, att: nn.Module, con1: nn.Module, xatt: nn.Module, conx: nn.Module, mlp: nn.Module,
                 con2: nn.Module):
        super().__init__(att, con1, mlp, con2)
        self.xatt, self.conx = xatt, conx
        self.to_xatt = Transition()      # CON layout -> XATT input layout (the queries' tokens)
        self.from_xatt = Transition()    # XATT output layout -> CON layout

    def parts(self) -> tuple:
        return (*super().parts(), ("xatt", self.to_xatt, self.from_xatt))

    cons = ("con1", "conx", "con2")

    def _steps(self, stream, x, context: dict, interleave: bool):
        # stream, x: [b, s_con, h] (decoder tokens); context: memory [b, S_src, h], cross (XATT's
        # context) and the self-attention's
        context = dict(context)
        memory, cross_context = context.pop("memory", None), context.pop("cross", None) or {}
        out, bias = yield from self._att(x, context, interleave)
        stream, x = self.con1(out, bias, stream)
        out, bias = self.xatt((yield from cross(self.to_xatt, x, interleave)), memory, **cross_context)
        stream, x = self.conx((yield from cross(self.from_xatt, out, interleave)), bias, stream)
        out, bias = yield from self._mlp(x, interleave)
        return self.con2(out, bias, stream)
