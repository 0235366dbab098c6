"""The block composer: ATT -> CON1 -> MLP -> CON2 with a Transition at every boundary.

The residual stream lives in the layout of the CONs (R or S). Each CON returns two tensors:
the residual stream and the input of the next sub-block. Post-norm (BERT) returns the same
tensor twice; pre-norm (Llama) returns the running sum and its normalised copy.
Transitions are identities until a plan sets them (serial training never pays for them).

comm_chunks > 1 (the config key of that name): a TP MLP runs over that many chunks of the
sequence, each chunk's all-gather in and reduce-scatter out (all-reduces under CON None)
travelling while other chunks' GEMMs run, in forward and backward (galaxy.distributed.overlap).
The MLP works token by token, so the result is the same up to summation order within a chunk.
"""
from __future__ import annotations

import torch
from torch import nn

from galaxy.distributed.overlap import chunked_tokenwise
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
        self.comm_chunks = 1           # chunks of the sequence the MLP's collectives travel in

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
        out, bias = self._mlp(x)
        return self.con2(out, bias, stream)

    def _mlp(self, x):
        """to_mlp -> MLP -> from_mlp, in comm_chunks overlapped chunks when the transitions allow."""
        if self.comm_chunks > 1:
            links_in = self.to_mlp.chunk_links(self.comm_chunks, x.shape[1])
            links_out = self.from_mlp.chunk_links(self.comm_chunks, x.shape[1])
            if links_in and links_out and len(links_in) == len(links_out) > 1:
                return chunked_tokenwise(x, self.mlp, len(links_in), links_in, links_out)
        out, bias = self.mlp(self.to_mlp(x))
        return self.from_mlp(out), bias
