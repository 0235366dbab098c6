"""Causal-LM data: plain-text lines, text records, chat records and instruction records, padded
to pad_size.

Formats (by extension):
  .txt             one sample per line; the loss covers every non-pad token.
  .json / .jsonl   a JSON array of records, or one object per line; each record is one of
                   (by the first of these fields it has):
      "messages"     chat: [{"role": system|user|assistant, "content"}, ...]; the loss covers the
                     assistant turns only (rendering: galaxy/data/chat.py)
      "instruction"  {"instruction", "input" (optional), "output"}; the loss covers the response
      "text"         {"text"} (e.g. openassistant-guanaco's "### Human: ... ### Assistant: ...");
                     the loss covers every token, as a .txt line
                   A record with none of them is an error naming its line and these fields.

Instruction prompt template (PROMPT_TEMPLATE / PROMPT_TEMPLATE_NO_INPUT):

    ### Instruction:
    {instruction}

    ### Input:            <- only when "input" is non-empty
    {input}

    ### Response:
    {output}<eos>

The prompt is tokenised as the tokenizer does by default (e.g. with a BOS token), the response
without special tokens, then EOS. Sequences longer than pad_size are truncated; shorter ones are
right-padded with the pad token (or EOS when the tokenizer has none). Labels are -100 on padding
and prompt tokens; the model shifts them (position t predicts token t + 1), as HF does.
"""
from __future__ import annotations

import json
import os

import torch

from .batches import StepBatches
from .chat import Chat, RenderedChat, encode_chat, parse_chat, render_chat, uses_chat_template
from .errors import DataError
from .pydoc_topics import pydoc_topics_dataset
from .readers import _lines

IGNORE_INDEX = -100
PROMPT_TEMPLATE = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
PROMPT_TEMPLATE_NO_INPUT = "### Instruction:\n{instruction}\n\n### Response:\n"


def format_prompt(instruction: str, input_text: str = "") -> str:
    if input_text:
        return PROMPT_TEMPLATE.format(instruction=instruction, input=input_text)
    return PROMPT_TEMPLATE_NO_INPUT.format(instruction=instruction)


def read_lm_samples(path: str) -> list[tuple[str, str | None]]:
    """[(prompt or text, response or None)]: response None means plain text (loss everywhere)."""
    ext = os.path.splitext(path)[1].lower()
    if ext == ".txt":
        return [(line, None) for _, line in _lines(path) if line.strip()]
    if ext not in (".json", ".jsonl"):
        raise DataError(f"{path}: unknown causal-LM data format {ext!r} (use .txt, .json or .jsonl)")
    return [_record(path, where, record) for where, record in _records(path)]


def _record(path, where, record):
    """One JSON record -> a sample: Chat, (prompt, response) or (text, None)."""
    if not isinstance(record, dict):
        raise DataError(f"{path}:{where}: expected a JSON object, got {type(record).__name__}")
    if "messages" in record:
        return parse_chat(path, where, record)
    if "instruction" in record:
        return _instruction(path, where, record)
    if "text" in record:
        if not isinstance(record["text"], str) or not record["text"].strip():
            raise DataError(f"{path}:{where}: 'text' must be a non-empty string")
        return record["text"], None
    raise DataError(f"{path}:{where}: a record with fields {sorted(record)} fits no format; expected "
                    f"\"text\" (plain text), \"messages\" (a chat: [{{\"role\", \"content\"}}, ...]) or "
                    f"\"instruction\" and \"output\" (an instruction record)")


def sample_kind(sample) -> str:
    if isinstance(sample, (Chat, RenderedChat)):
        return "chat"
    return "text" if sample[1] is None else "instruction"


def describe_samples(path: str, samples, tokenizer) -> str:
    """What a data file held, for the run's notes: its formats and where the loss falls."""
    counts = {}
    for s in samples:
        counts[sample_kind(s)] = counts.get(sample_kind(s), 0) + 1
    loss = {"text": "loss on every token", "instruction": "loss on the response",
            "chat": "loss on the assistant turns, rendered with " +
                    ("the tokenizer's chat template" if uses_chat_template(tokenizer)
                     else "galaxy's ### Human / ### Assistant template")}
    found = "; ".join(f"{n} {kind} records ({loss[kind]})" for kind, n in counts.items())
    return f"{path}: {found}"


def render_samples(samples, tokenizer) -> list:
    """Chat samples rendered for this tokenizer once, up front (errors name the record)."""
    return [render_chat(tokenizer, s) if isinstance(s, Chat) else s for s in samples]


def _records(path):
    with open(path, encoding="utf-8-sig") as f:
        head = f.read(1 << 16).lstrip()
    if head.startswith("["):                  # a JSON array of records
        try:
            with open(path, encoding="utf-8-sig") as f:
                records = json.load(f)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: bad JSON ({e.msg} at column {e.colno})") from None
        # The array's own line numbers are lost; report the record's index instead.
        return [(f"record {i}", r) for i, r in enumerate(records)]
    out = []
    for number, line in _lines(path):
        if not line.strip():
            continue
        try:
            out.append((number, json.loads(line)))
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{number}: bad JSON ({e.msg} at column {e.colno})") from None
    return out


def _instruction(path, where, record):
    for key in ("instruction", "output"):
        if not isinstance(record.get(key), str) or not record[key].strip():
            raise DataError(f"{path}:{where}: {key!r} must be a non-empty string")
    input_text = record.get("input") or ""
    if not isinstance(input_text, str):
        raise DataError(f"{path}:{where}: 'input' must be a string")
    return format_prompt(record["instruction"], input_text), record["output"]


def load_lm_samples(path_or_none, split: str):
    """A file's samples, or (None) the passages of the embedded pydoc-topics dataset as text."""
    if path_or_none is None:
        return [(text, None) for text, _ in pydoc_topics_dataset(split)[0]]
    return read_lm_samples(os.fspath(path_or_none))


def encode_sample(tokenizer, sample, pad_size: int):
    """Any sample (text or instruction pair, rendered chat) -> encode_lm_sample's tensors."""
    if isinstance(sample, RenderedChat):
        return _padded(tokenizer, *encode_chat(tokenizer, sample, pad_size, IGNORE_INDEX), pad_size)
    return encode_lm_sample(tokenizer, *sample, pad_size)


def encode_lm_sample(tokenizer, prompt: str, response: str | None, pad_size: int):
    """-> (input_ids [pad_size], attention_mask [pad_size], labels [pad_size]) long tensors."""
    ids = tokenizer(prompt)["input_ids"]
    labels = list(ids) if response is None else [IGNORE_INDEX] * len(ids)
    if response is not None:
        answer = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids, labels = ids + answer, labels + answer
    return _padded(tokenizer, ids, labels, pad_size)


def _padded(tokenizer, ids, labels, pad_size: int):
    ids, labels = ids[:pad_size], labels[:pad_size]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    n = len(ids)
    return (torch.tensor(ids + [pad] * (pad_size - n)),
            torch.tensor([1] * n + [0] * (pad_size - n)),
            torch.tensor(labels + [IGNORE_INDEX] * (pad_size - n)))


class CausalLMBatches(StepBatches):
    """Global batches of causal-LM samples: input_ids, attention_mask, labels, each [B, pad_size]."""

    def __init__(self, samples, tokenizer, pad_size, batch_size, shuffle, seed=0, shard=None):
        super().__init__(samples, batch_size, shuffle, seed, shard)
        self.tokenizer = tokenizer
        self.pad_size = pad_size

    def encode(self, indices):
        rows = [encode_sample(self.tokenizer, self.samples[i], self.pad_size) for i in indices.tolist()]
        ids, mask, labels = (torch.stack(t) for t in zip(*rows))
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
