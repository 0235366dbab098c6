"""A decode step's LM head split by vocabulary rows over the last stage's Galaxy group.

The sampler alone ran the LM head on every step, a [vocab, h] product as large as several layers
(the bench Llama's 32000 x 1024 is 2.6 of its 8 layers' weights), while the other ranks waited for
its choice. While decoding, the head's input is replicated (the decode layouts put the residual
stream in R), so each rank can score its own rows of the vocabulary, in proportion to its MLP
column share in a decode step (the plan's measure of its speed: a TP MLP's columns, an SP MLP's
decode_columns), and one all-gather of the [b, vocab_r] pieces
gives the sampler every logit: a few tens of KB on the link against half the head's weight read.
The sampler then chooses as before (greedy, sampling, beams), from the same logits up to the
rounding of a product of another width. A batch of greedy rows needs no logits at all: each rank
sends its rows' best logit and its index (greedy_tokens, [b, 2]), 16 bytes a row where the
gathered logits of the bench Llama are 128 KB.

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
    """The LM head of a decode step on this rank's vocabulary rows, gathered over the group (over
    its TokenLink `link` where the engine has one, else the process group)."""

    def __init__(self, model, group: GalaxyGroup, link=None):
        self.model, self.group, self.link = model, group, link
        plan = model.attached.plan
        self.shares = vocab_shares(model.lm_head.weight.shape[0], plan.decode_mlp_columns() if plan else group.columns)
        start = sum(self.shares[:group.rank])
        self.rows = slice(start, start + self.shares[group.rank])

    @staticmethod
    def applies(model, group: GalaxyGroup, is_last_stage: bool) -> bool:
        """A causal LM's last stage split over two or more ranks."""
        return is_last_stage and group.size > 1 and model.task == "causal_lm" and hasattr(model, "lm_head")

    def _own_logits(self, carry: tuple) -> torch.Tensor:
        """The carry after the last layer (one token per row, replicated) -> this rank's rows of
        the logits [b, vocab_r] (fp32)."""
        m = self.model
        x = m.head_input(tuple(t[:, -1:] for t in carry))                     # [b, 1, h]
        return m.vocab_slice_logits(x, self.rows)[:, -1].float().contiguous()   # [b, vocab_r]

    def logits(self, carry: tuple) -> torch.Tensor:
        """-> logits [b, vocab] (fp32) on every rank of the group."""
        own = self._own_logits(carry)
        if self.link is not None:
            b = own.shape[0]
            return torch.cat(self.link.exchange(own, [(b, n) for n in self.shares]), dim=-1)
        return all_gather_sequence(own, self.shares, self.group.pg)            # [b, vocab]

    def greedy_tokens(self, carry: tuple) -> torch.Tensor:
        """-> every row's argmax over the whole vocabulary [b] (long), on every rank of the group,
        without gathering the logits: each rank's best logit and its index ([b, 2], float64 holds
        both exactly), and the first rank holding the largest (torch's argmax: the first of equal
        maxima, here the lowest index, as over the gathered logits)."""
        best, at = self._own_logits(carry).max(-1)                              # [b], [b]: first maxima
        mine = torch.stack((best.double(), (at + self.rows.start).double()), dim=-1)   # [b, 2]
        if self.link is not None:
            every = torch.stack(self.link.exchange(mine), dim=1)               # [b, n, 2]
        else:
            every = all_gather_sequence(mine[:, None], (1,) * self.group.size, self.group.pg)   # [b, n, 2]
        winner = every[..., 0].argmax(dim=1, keepdim=True)                      # [b, 1]: first largest rank
        return every[..., 1].gather(1, winner)[:, 0].long()                     # [b]
