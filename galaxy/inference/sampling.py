"""Choosing the next token from a row's logits: greedy, or sampling with temperature, top-k, top-p.

One rank of each replica chooses (the sampler, galaxy.inference.engine) and the others receive its
choice, so every rank continues with the same token even where their devices would round the
logits differently. Each row draws from its own generator, seeded by its request's seed: a
prompt's completion does not depend on the other prompts of its batch, on the batch size or on how
the data-parallel replicas split the prompts, and a seeded run under any plan draws what the
serial run draws (to the rounding of the logits, which a draw almost never straddles).

The filters are Hugging Face's sampling warpers, in its order: temperature, then top-k (keep the k
largest logits), then top-p (keep the smallest set of most likely tokens whose probability
reaches top_p), then one draw from the softmax of what is left.

Beams holds beam search's settings (num_beams > 1: galaxy.inference.beam_search), which replace
this choice of one token per row.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0      # 0: greedy (argmax), no draw
    top_k: int = 0                # 0: no top-k filter
    top_p: float = 1.0            # 1: no top-p filter
    seed: int = 0                 # the row's generator seed (sampling only)

    def problems(self) -> list[str]:
        """What is out of range, one phrase each (the caller names the flag or field)."""
        out = []
        if not self.temperature >= 0:
            out.append(f"temperature must be at least 0, got {self.temperature}")
        if self.top_k < 0:
            out.append(f"top_k must be at least 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            out.append(f"top_p must be in (0, 1], got {self.top_p}")
        return out

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


LOST = -1.0e9            # a beam score that may not be chosen (Hugging Face's constant)


@dataclass(frozen=True)
class Beams:
    num_beams: int = 1                      # 1: no beam search (greedy or sampled, galaxy.inference.sampling)
    length_penalty: float = 1.0             # a hypothesis' score: sum of log-probs / length ** length_penalty
    early_stopping: bool | str = False      # True, False or "never" (Hugging Face's meanings)

    def problems(self) -> list[str]:
        """What is out of range, one phrase each (the caller names the flag)."""
        out = []
        if self.num_beams < 1:
            out.append(f"num_beams must be at least 1, got {self.num_beams}")
        if self.early_stopping not in (True, False, "never"):
            out.append(f"early_stopping must be true, false or never, got {self.early_stopping!r}")
        return out


def generator_for(sampling: Sampling, device) -> torch.Generator | None:
    """A row's own generator (None for greedy rows)."""
    if sampling.greedy:
        return None
    return torch.Generator(device=device).manual_seed(sampling.seed % 2 ** 63)


def choose(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """One row's next token from its logits [vocab] (fp32)."""
    if sampling.greedy:
        return int(logits.argmax())
    scores = logits / sampling.temperature
    if 0 < sampling.top_k < scores.numel():
        kth = torch.topk(scores, sampling.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1:
        scores = _top_p(scores, sampling.top_p)
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def _top_p(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Drop the least likely tokens whose total probability stays within 1 - top_p (the most
    likely token always stays)."""
    ordered, order = torch.sort(scores)                                 # ascending
    cumulative = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
    drop = cumulative <= 1 - top_p
    drop[-1] = False
    return scores.masked_fill(drop.scatter(0, order, drop), float("-inf"))
