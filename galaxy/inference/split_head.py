"""A decode step's LM head split by vocabulary rows over the last stage's Galaxy group.

The sampler alone ran the LM head on every step, a [vocab, h] product as large as several layers
(the bench Llama's 32000 x 1024 is 2.6 of its 8 layers' weights), while the other ranks waited for
its choice. While decoding, the head's input is replicated (the decode layouts put the residual
stream in R), so each rank can score its own rows of the vocabulary, in proportion to its MLP
column share in a decode step (the plan's measure of its speed: a TP MLP's columns, an SP MLP's
decode_columns), and one all-gather of the [b, vocab_r] pieces
gives the sampler every logit: a few tens of KB on the link against half the head's weight read.
The sampler then chooses as before (greedy, sampling, beams), from the same logits up to the
rounding of a product of another width.

The prefill keeps the sampler's whole head: under CON SP only the last rank holds the last prompt
token.
"""
from __future__ import annotations

import torch

from galaxy.distributed.collectives import all_gather_sequence
from galaxy.distributed.group import GalaxyGroup


def vocab_shares(vocab: int, weights) -> tuple[int, ...]:
    """Rows of the vocabulary per rank, in proportion to the ranks' decode MLP columns (weights)."""
    total, bounds = sum(weights), [0]
    for i in range(1, len(weights) + 1):
        bounds.append(round(vocab * sum(weights[:i]) / total))
    return tuple(b - a for a, b in zip(bounds, bounds[1:]))


class SplitHead:
    """The LM head of a decode step on this rank's vocabulary rows, gathered over the group."""

    def __init__(self, model, group: GalaxyGroup):
        self.model, self.group = model, group
        plan = model.attached.plan
        self.shares = vocab_shares(model.lm_head.weight.shape[0], plan.decode_mlp_columns() if plan else group.columns)
        start = sum(self.shares[:group.rank])
        self.rows = slice(start, start + self.shares[group.rank])

    @staticmethod
    def applies(model, group: GalaxyGroup, is_last_stage: bool) -> bool:
        """A causal LM's last stage split over two or more ranks."""
        return is_last_stage and group.size > 1 and model.task == "causal_lm" and hasattr(model, "lm_head")

    def logits(self, carry: tuple) -> torch.Tensor:
        """The carry after the last layer (one token per row, replicated) -> logits [b, vocab] (fp32)
        on every rank of the group."""
        m = self.model
        x = m.head_input(tuple(t[:, -1:] for t in carry))                     # [b, 1, h]
        own = m.vocab_slice_logits(x, self.rows)[:, -1].float()                 # [b, vocab_r]
        return all_gather_sequence(own.contiguous(), self.shares, self.group.pg)    # [b, vocab]
