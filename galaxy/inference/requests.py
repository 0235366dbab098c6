"""What is asked (Request), how each row stands while generating (Progress), what comes out
(Completion), and the text of a row as it grows (TextStream).

A row stops at the first of: an end-of-sequence token (unless ignore_eos), a stop string in its
text, max_new_tokens. completion_tokens holds every token generated, the one that ended the row
included (the EOS, or the token that completed a stop string); the text leaves out special tokens
and is cut before the stop string, as OpenAI's API returns it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from galaxy.inference.sampling import Beams, Sampling, choose, generator_for

RUNNING, STOPPED, LENGTH = 0, 1, 2           # a row's status, as the sampler broadcasts it
FINISH = {STOPPED: "stop", LENGTH: "length"}
FINISH_CODE = {reason: code for code, reason in FINISH.items()}


@dataclass(frozen=True)
class Request:
    prompt: str                         # as given, for the output record
    ids: tuple[int, ...]                # the tokenized prompt
    max_new_tokens: int
    sampling: Sampling = Sampling()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    beams: Beams = Beams()              # num_beams > 1: beam search (galaxy.inference.beam_search)


@dataclass
class Completion:
    prompt: str
    tokens: list[int]
    finish_reason: str                  # "stop" | "length"
    text: str

    def record(self) -> dict:
        """generate.py's output line."""
        return {"prompt": self.prompt, "completion": self.text, "completion_tokens": self.tokens,
                "finish_reason": self.finish_reason}


def cut_at_stop(text: str, stop: tuple[str, ...]) -> tuple[str, bool]:
    """(text before the earliest stop string, whether one was found)."""
    hits = [text.find(s) for s in stop if s and s in text]
    return (text[:min(hits)], True) if hits else (text, False)


@dataclass
class Progress:
    """Every row of one batch while it generates; the same on every rank of the replica."""
    requests: list[Request]
    tokenizer: object
    eos: frozenset[int]
    pad: int
    tokens: list[list[int]] = field(default_factory=list)
    status: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.tokens = [[] for _ in self.requests]
        self.status = [RUNNING] * len(self.requests)
        self.generators = None

    parents = None                      # beams' reordering of the rows (BeamProgress); none here

    @property
    def done(self) -> bool:
        return all(s != RUNNING for s in self.status)

    @property
    def rows(self) -> list[Request]:
        """The batch's rows: one per request."""
        return self.requests

    @property
    def packed_shape(self) -> tuple[int, int]:
        """The sampler's broadcast of a step: [b, 2] (token, status)."""
        return len(self.requests), 2

    def last_tokens(self) -> list[int]:
        return [t[-1] for t in self.tokens]

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """The sampler's pick for every row from logits [b, vocab] (fp32) -> [b, 2] (token, status);
        finished rows get the pad token and keep their status."""
        self._make_generators(logits.device)
        return self.take([choose(logits[i], r.sampling, g) if self.status[i] == RUNNING else None
                          for i, (r, g) in enumerate(zip(self.requests, self.generators))])

    def take(self, tokens: list) -> torch.Tensor:
        """Every row's next token chosen elsewhere (tokens[i]; a finished row's is ignored) ->
        [b, 2] (token, status) as choose gives it."""
        out = torch.empty(len(self.requests), 2, dtype=torch.long)
        for i, token in enumerate(tokens):
            if self.status[i] != RUNNING:
                out[i] = torch.tensor([self.pad, self.status[i]])
            else:
                out[i] = torch.tensor([token, self._status_after(i, token)])
        return out

    def _make_generators(self, device) -> None:
        if self.generators is None:
            self.generators = [generator_for(r.sampling, device) for r in self.requests]

    def generator_states(self, device) -> torch.Tensor:
        """[sampled rows, state bytes] (uint8, CPU): every sampled row's generator state, in row
        order (the generators made, seeded, if no draw has made them yet)."""
        self._make_generators(device)
        states = [g.get_state() for g in self.generators if g is not None]
        return torch.stack(states) if states else torch.empty(0, 0, dtype=torch.uint8)

    def set_generator_states(self, states: torch.Tensor) -> None:
        """Take generator_states' rows (another rank's): this rank then draws what that one draws."""
        for g, state in zip((g for g in self.generators if g is not None), states):
            g.set_state(state.clone())       # its own storage: set_state reads from the storage start

    def _status_after(self, i: int, token: int) -> int:
        r, tokens = self.requests[i], self.tokens[i] + [token]
        if token in self.eos and not r.ignore_eos:
            return STOPPED
        if r.stop and cut_at_stop(self.tokenizer.decode(tokens, skip_special_tokens=True), r.stop)[1]:
            return STOPPED
        return LENGTH if len(tokens) >= r.max_new_tokens else RUNNING

    def record(self, packed: torch.Tensor) -> list[tuple[int, int, int]]:
        """Take the sampler's [b, 2] choice; returns (row, token, status) of the rows that ran."""
        ran = []
        for i, (token, status) in enumerate(packed.tolist()):
            if self.status[i] == RUNNING:
                self.tokens[i].append(token)
                self.status[i] = status
                ran.append((i, token, status))
        return ran

    def completions(self) -> list[Completion]:
        out = []
        for r, tokens, status in zip(self.requests, self.tokens, self.status):
            text, _ = cut_at_stop(self.tokenizer.decode(tokens, skip_special_tokens=True), r.stop)
            out.append(Completion(r.prompt, tokens, FINISH[status], text))
        return out


class TextStream:
    """A row's text as it grows, in pieces safe to send: nothing that might still become a stop
    string, and no half of a multi-byte character (the decoder's U+FFFD)."""

    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.tokenizer, self.stop = tokenizer, stop
        self.sent = 0
        self.hold = max((len(s) for s in stop), default=1) - 1

    def piece(self, tokens: list[int], finished: bool) -> str:
        """The text not sent yet, of the row's tokens so far."""
        text, _ = cut_at_stop(self.tokenizer.decode(tokens, skip_special_tokens=True), self.stop)
        end = len(text) if finished else max(self.sent, len(text) - self.hold)
        while not finished and end > self.sent and text[end - 1] == "\ufffd":
            end -= 1
        piece, self.sent = text[self.sent:end], max(self.sent, end)
        return piece
