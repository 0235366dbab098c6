"""The block composer: ATT -> CON1 -> MLP -> CON2 with a Transition at every boundary.

The residual stream lives in the layout of the CONs (R or S). Each CON returns two tensors:
the residual stream and the input of the next sub-block. Post-norm (BERT) returns the same
tensor twice; pre-norm (Llama) returns the running sum and its normalised copy.
Transitions are identities until a plan sets them (serial training never pays for them).

comm_chunks > 1 (the config key of that name): a TP ATT or MLP runs over that many chunks of
the sequence, each chunk's all-gather in and reduce-scatter out (all-reduces under CON None)
travelling while other chunks' GEMMs run, in forward and backward (galaxy.distributed.overlap).
The MLP works token by token; ATT's projections do (`project` and `finish`, per chunk) and its
core (`attend`) runs once over the whole sequence. The result is the same up to summation order.

Batch streams (the plan's batch_streams, galaxy.distributed.streams): `steps` is the layer as a
generator that yields right after starting each boundary's collective (a Transition's Link; with
comm_chunks, after the chunks' collectives start), so the model's layer loop can run another
stream's sub-block while it travels. The plain forward runs the same steps without interleaving,
each transition a blocking collective. A recomputed layer (activation checkpointing) runs whole
in each stream: torch's checkpoint records one forward at a time.
"""
from __future__ import annotations

import torch
from torch import nn

from galaxy.distributed.overlap import chunked_attention_steps, chunked_tokenwise_steps, start, wait
from galaxy.distributed.streams import run_to_end
from galaxy.distributed.transitions import Transition
from galaxy.layers.recompute import run_checkpointed


class TransformerBlock(nn.Module):
    # Whose tokens the CON layout splits: "source" (this group's token shares) or "target" (an
    # encoder-decoder's decoder layers, galaxy.layers.decoder_block: the decoder's shares).
    sequence = "source"
    cons = ("con1", "con2")        # the CONs, each on the CON layout

    def __init__(self, att: nn.Module, con1: nn.Module, mlp: nn.Module, con2: nn.Module):
        super().__init__()
        self.att, self.con1, self.mlp, self.con2 = att, con1, mlp, con2
        self.to_att = Transition()     # CON layout -> ATT input layout
        self.from_att = Transition()   # ATT output layout -> CON layout
        self.to_mlp = Transition()
        self.from_mlp = Transition()
        # Activation checkpointing (set_recompute): recompute this block in backward.
        self.recompute, self.recompute_rng = False, None
        self.comm_chunks = 1           # chunks of the sequence a TP sub-block's collectives travel in

    def parts(self) -> tuple:
        """The sub-blocks a plan splits, each with its transitions: (name, into, out of)."""
        return (("att", self.to_att, self.from_att), ("mlp", self.to_mlp, self.from_mlp))

    def set_recompute(self, on: bool, rng=None) -> None:
        """Keep only this block's inputs for backward and recompute the rest (galaxy.layers.
        recompute); rng: the sharded dropout stream its sub-blocks draw from, if any."""
        self.recompute, self.recompute_rng = on, rng

    def set_overlap(self, plan) -> None:
        """How this layer overlaps communication with compute, by the plan's options (galaxy.plan):
        a TP ATT's and MLP's transitions travel in `plan.comm_chunks` chunks of the sequence; with
        `plan.kv_blocks` an SP ATT attends to its own keys while the K/V all-gather travels
        (galaxy.layers.self_attention). apply_plan calls it."""
        self.comm_chunks = plan.comm_chunks
        self.att.kv_blocks = plan.kv_blocks

    def forward(self, stream, x, **att_kwargs):
        # stream, x: [b, s_con, h] in the CON layout (s_con = full or local sequence)
        if self.recompute and torch.is_grad_enabled():
            return run_checkpointed(self._forward, stream, x, rng=self.recompute_rng, **att_kwargs)
        return self._forward(stream, x, **att_kwargs)

    def _forward(self, stream, x, **att_kwargs):
        return run_to_end(self._steps(stream, x, att_kwargs, interleave=False))

    def steps(self, stream, x, context: dict, interleave: bool = True):
        """This layer as steps (a generator returning forward's result): with `interleave`, it
        yields after starting each boundary's collective and waits for it when resumed; a
        recomputed layer, or interleave False, runs whole (no yield)."""
        if not interleave or (self.recompute and torch.is_grad_enabled()):
            return self(stream, x, **context)
        return (yield from self._steps(stream, x, context, interleave))

    def _steps(self, stream, x, att_kwargs: dict, interleave: bool):
        out, bias = yield from self._att(x, att_kwargs, interleave)
        stream, x = self.con1(out, bias, stream)
        out, bias = yield from self._mlp(x, interleave)
        return self.con2(out, bias, stream)

    def _att(self, x, att_kwargs: dict, interleave: bool):
        """to_att -> ATT -> from_att, in comm_chunks overlapped chunks when the transitions allow."""
        links = self._chunk_links(self.to_att, self.from_att, x.shape[1])
        if links:
            return (yield from chunked_attention_steps(x, self.att, len(links[0]), *links, **att_kwargs))
        out, bias = self.att((yield from cross(self.to_att, x, interleave)), **att_kwargs)
        return (yield from cross(self.from_att, out, interleave)), bias

    def _mlp(self, x, interleave: bool):
        """to_mlp -> MLP -> from_mlp, in comm_chunks overlapped chunks when the transitions allow."""
        links = self._chunk_links(self.to_mlp, self.from_mlp, x.shape[1])
        if links:
            return (yield from chunked_tokenwise_steps(x, self.mlp, len(links[0]), *links))
        out, bias = self.mlp((yield from cross(self.to_mlp, x, interleave)))
        return (yield from cross(self.from_mlp, out, interleave)), bias

    def _chunk_links(self, into: Transition, out_of: Transition, seq_len: int):
        """(links in, links out) of a TP sub-block's transitions in comm_chunks chunks, or None
        when chunking is off or the transitions are not ones that chunk (Transition.chunk_links)."""
        if self.comm_chunks <= 1:
            return None
        links_in = into.chunk_links(self.comm_chunks, seq_len)
        links_out = out_of.chunk_links(self.comm_chunks, seq_len)
        if links_in and links_out and len(links_in) == len(links_out) > 1:
            return links_in, links_out
        return None


def cross(transition: Transition, x, interleave: bool):
    """x through a sub-block boundary, as a step: at once (a blocking collective), or with
    `interleave` its Link started, a yield (another stream's turn), then its wait."""
    link = transition.link() if interleave else None
    if link is None:
        return transition(x)
    token = start(x, link)
    yield
    return wait(token, link)
