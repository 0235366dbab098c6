"""Beam search with Hugging Face generate(num_beams=K, do_sample=False)'s rules: the beams of a
prompt are K rows of the batch, and every step keeps the K best running continuations.

Per prompt (all in fp32, tensors [n prompts, K beams, ...]):

  score     a beam's running score is the sum of its tokens' log-softmax; at the start only beam
            0 counts (the others start at -1e9), since the K rows of a prompt are identical.
  step      over the K x vocab continuations take the best `keep` = max(2, 1 + #EOS) x K; those
            whose token ends the row (an EOS, or the row's max_new_tokens-th token) leave the
            running set, and the K best of the rest run on (their parents: the rows each one
            continues, so every rank reorders its caches' rows by them).
  finished  an ended continuation among the K best candidates (the first K of `keep`) becomes a
            hypothesis scored sum / generated_length ** length_penalty; a prompt keeps its K
            best hypotheses, unless early_stopping=True and all K are filled, or it is closed.
  closed    once all K hypotheses are filled and the best running beam's score divided by
            length ** length_penalty (length: the tokens generated so far; "never" with a positive
            penalty: max_new_tokens) cannot beat the worst of them, a prompt takes no more.
  the end   when no prompt is open, or (early_stopping=True) every hypothesis is filled, or every
            candidate ended. The answer is each prompt's best hypothesis.

The sampler (galaxy.inference.engine) runs BeamSearch on the logits and broadcasts [n K + 1, 2]:
(token, parent row) per running row, then (all done, 0); every rank's BeamProgress takes it.
"""
from __future__ import annotations

import torch

from galaxy.inference.requests import Completion, Request, cut_at_stop
from galaxy.inference.sampling import LOST


def gather(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t [n, m, ...] at index [n, j] along dim 1 -> [n, j, ...]."""
    while index.dim() < t.dim():
        index = index.unsqueeze(-1)
    return torch.take_along_dim(t, index, dim=1)


class BeamSearch:
    """The sampler's state: running beams and finished hypotheses of n prompts."""

    def __init__(self, requests: list[Request], eos: frozenset[int], pad: int):
        beams = requests[0].beams
        self.k, self.n, self.pad = beams.num_beams, len(requests), pad
        self.penalty, self.early = beams.length_penalty, beams.early_stopping
        n, k = self.n, self.k
        self.max_new = torch.tensor([r.max_new_tokens for r in requests])                       # [n]
        self.eos = torch.tensor(sorted(eos), dtype=torch.long)
        self.ignore_eos = torch.tensor([r.ignore_eos for r in requests])                        # [n]
        self.keep = max(2, 1 + len(eos)) * k
        width = int(self.max_new.max())
        self.running = torch.zeros(n, k)
        self.running[:, 1:] = LOST
        self.sequences = torch.full((n, k, width), pad, dtype=torch.long)                      # running beams' tokens
        self.scores = torch.full((n, k), LOST)                                                  # hypotheses
        self.hypotheses = self.sequences.clone()
        self.lengths = torch.zeros(n, k, dtype=torch.long)
        self.finished = torch.zeros(n, k, dtype=torch.bool)
        self.open = torch.ones(n, 1, dtype=torch.bool)
        self.step = 0

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [n K, vocab] (fp32, row i K + j: beam j of prompt i) -> [n K + 1, 2]."""
        n, k, t = self.n, self.k, self.step
        log_probs = torch.log_softmax(logits.float().cpu(), dim=-1)
        vocab = log_probs.shape[-1]
        totals = (log_probs.view(n, k, vocab) + self.running[:, :, None]).view(n, k * vocab)
        top, flat = torch.topk(totals, self.keep)                                              # [n, keep]
        parents, tokens = flat // vocab, flat % vocab
        candidates = gather(self.sequences, parents)                                           # [n, keep, width]
        candidates[:, :, t] = tokens
        ended = self._ends(tokens, t)
        alive = top + ended.float() * LOST
        best = torch.topk(alive, k).indices                                                    # [n, K]
        self._finish(candidates, top, ended, t)
        self.sequences, self.running = gather(candidates, best), gather(alive, best)
        self.step = t + 1
        self._close_hopeless()
        done = not (bool(self.open.any()) and not (bool(self.finished.all()) and self.early is True)
                    and not bool(ended.all()))
        rows = gather(parents, best) + torch.arange(n)[:, None] * k                            # [n, K]: parent rows
        packed = torch.stack((gather(tokens, best).flatten(), rows.flatten()), dim=1)
        return torch.cat((packed, torch.tensor([[int(done), 0]])))

    def _ends(self, tokens: torch.Tensor, t: int) -> torch.Tensor:
        """[n, keep] bool: the continuation ends its row (an EOS, or the row's last token)."""
        eos = torch.isin(tokens, self.eos) & ~self.ignore_eos[:, None]
        return eos | (t + 1 >= self.max_new)[:, None]

    def _finish(self, candidates, top, ended, t: int) -> None:
        """Merge the ended continuations among the K best candidates into the K best hypotheses."""
        just = ended.clone()
        just[:, self.k:] = False
        scores = top / ((t + 1) ** self.penalty)
        full = self.finished.all(dim=-1, keepdim=True) & (self.early is True)
        scores += full.float() * LOST
        scores += (~self.open).float() * LOST
        scores += (~just) * LOST
        lengths = torch.full_like(just, t + 1, dtype=torch.long)
        merged = torch.cat((self.scores, scores), dim=1)
        best = torch.topk(merged, self.k).indices
        self.scores = gather(merged, best)
        self.hypotheses = gather(torch.cat((self.hypotheses, candidates), dim=1), best)
        self.lengths = gather(torch.cat((self.lengths, lengths), dim=1), best)
        self.finished = gather(torch.cat((self.finished, just), dim=1), best)

    def _close_hopeless(self) -> None:
        """A prompt whose best running beam cannot beat its worst hypothesis takes no more."""
        if self.early == "never" and self.penalty > 0:
            bound = torch.tensor([m ** self.penalty for m in self.max_new.tolist()])[:, None]
        else:
            bound = self.step ** self.penalty
        possible = self.running[:, :1] / bound
        worst = torch.where(self.finished, self.scores.min(dim=1, keepdim=True)[0], LOST)
        self.open = self.open & (possible > worst).any(dim=-1, keepdim=True)

    def answers(self) -> torch.Tensor:
        """[n, 1 + width]: each prompt's best hypothesis, its length then its tokens."""
        return torch.cat((self.lengths[:, :1], self.hypotheses[:, 0]), dim=1)


class BeamProgress:
    """Every rank's view of a beam search: the rows' last tokens and the parents of each step,
    as the sampler broadcasts them (Progress's interface, for the engines)."""

    def __init__(self, requests: list[Request], tokenizer, eos: frozenset[int], pad: int):
        self.requests, self.tokenizer, self.eos, self.pad = requests, tokenizer, eos, pad
        self.k = requests[0].beams.num_beams
        if any(r.beams != requests[0].beams for r in requests):
            raise ValueError("the requests of one beam-search batch must share their Beams")
        self.rows = [r for r in requests for _ in range(self.k)]      # beam j of prompt i: row i K + j
        self.last = [None] * len(self.rows)
        self.parents: torch.Tensor | None = None                      # [n K]: the row each row continues
        self.done = False
        self.search = None

    @property
    def packed_shape(self) -> tuple[int, int]:
        return len(self.rows) + 1, 2

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        if self.search is None:
            self.search = BeamSearch(self.requests, self.eos, self.pad)
        return self.search.choose(logits)

    def record(self, packed: torch.Tensor) -> list:
        """Take the sampler's step; no token is final before the end (nothing to stream)."""
        self.last = packed[:-1, 0].tolist()
        self.parents = packed[:-1, 1].clone()
        self.done = bool(packed[-1, 0])
        return []

    def last_tokens(self) -> list[int]:
        return self.last

    @property
    def answers_shape(self) -> tuple[int, int]:
        return len(self.requests), 1 + max(r.max_new_tokens for r in self.requests)

    def answers(self) -> torch.Tensor:
        return self.search.answers()

    def completions(self, answers: torch.Tensor) -> list[Completion]:
        """From the sampler's answers [n, 1 + width]."""
        out = []
        for r, row in zip(self.requests, answers.tolist()):
            tokens = row[1:1 + row[0]]
            stopped = bool(tokens) and tokens[-1] in self.eos and not r.ignore_eos
            text, _ = cut_at_stop(self.tokenizer.decode(tokens, skip_special_tokens=True), r.stop)
            out.append(Completion(r.prompt, tokens, "stop" if stopped else "length", text))
        return out
