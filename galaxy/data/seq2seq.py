"""Sequence-to-sequence data (BART, T5): (source, target) pairs, the source padded to pad_size and
the target to target_pad_size.

Formats (by extension):
  .tsv / .txt      `source<TAB>target` per line (the target after the last tab)
  .json / .jsonl   a JSON array of records, or one object per line; each record is one of (by the
                   first pair of fields it has):
      "source", "target"
      "input", "output"            (without "instruction")
      "instruction", "output"      alpaca: the source is the instruction, then a blank line and
                                   "input" when it is non-empty
  none             the embedded pydoc-topics passages, each with its topic's title as the target
                   (galaxy.data.pydoc_topics.pydoc_titles_dataset)

Encoding, as Hugging Face's seq2seq examples do: input_ids = tokenizer(source) with its special
tokens (BART: <s> ... </s>; T5: ... </s>), truncated to pad_size; labels = tokenizer(target),
truncated to target_pad_size, -100 on padding. The model makes the decoder's inputs from the
labels (shifted right after its start token); decoder_attention_mask keeps the positions whose
input is the start token or a target token.
"""
from __future__ import annotations

import os

import torch

from .batches import StepBatches
from .causal_lm import IGNORE_INDEX, _records
from .errors import DataError
from .pydoc_topics import pydoc_titles_dataset
from .readers import _lines

RECORD_FIELDS = (("source", "target"), ("instruction", "output"), ("input", "output"))


def read_pairs(path: str) -> list[tuple[str, str]]:
    """[(source, target)] of a TSV or JSON(L) file; a DataError names the line of a bad one."""
    ext = os.path.splitext(path)[1].lower()
    if ext in (".tsv", ".txt"):
        return [_tsv_pair(path, number, line) for number, line in _lines(path) if line.strip()]
    if ext not in (".json", ".jsonl"):
        raise DataError(f"{path}: unknown sequence-to-sequence data format {ext!r} (use .tsv, .json or .jsonl)")
    pairs = [_record_pair(path, where, record) for where, record in _records(path)]
    if not pairs:
        raise DataError(f"{path}: no examples")
    return pairs


def _tsv_pair(path, number, line):
    if "\t" not in line:
        raise DataError(f"{path}:{number}: missing tab between source and target")
    source, target = (part.strip() for part in line.rsplit("\t", 1))
    if not source or not target:
        raise DataError(f"{path}:{number}: empty {'source' if not source else 'target'}")
    return source, target


def _record_pair(path, where, record):
    if not isinstance(record, dict):
        raise DataError(f"{path}:{where}: expected a JSON object, got {type(record).__name__}")
    fields = next((f for f in RECORD_FIELDS if all(k in record for k in f)), None)
    if fields is None:
        raise DataError(f"{path}:{where}: a record with fields {sorted(record)} fits no format; expected "
                        f"\"source\" and \"target\", \"input\" and \"output\", or \"instruction\" and \"output\"")
    for name in fields:
        if not isinstance(record[name], str) or not record[name].strip():
            raise DataError(f"{path}:{where}: {name!r} must be a non-empty string")
    source, target = (record[name] for name in fields)
    extra = (record.get("input") or "") if fields[0] == "instruction" else ""
    if not isinstance(extra, str):
        raise DataError(f"{path}:{where}: 'input' must be a string")
    return (f"{source}\n\n{extra}" if extra else source), target


def load_pairs(path_or_none, split: str) -> list[tuple[str, str]]:
    """A file's pairs, or (None) the embedded pydoc-topics split as passage -> title."""
    return pydoc_titles_dataset(split) if path_or_none is None else read_pairs(os.fspath(path_or_none))


def encode_pairs(tokenizer, pairs, pad_size: int, target_pad_size: int) -> dict:
    """[(source, target)] -> input_ids, attention_mask [B, pad_size]; labels, decoder_attention_mask
    [B, target_pad_size] (long tensors)."""
    sources = tokenizer([s for s, _ in pairs], padding="max_length", truncation=True, max_length=pad_size,
                        return_tensors="pt")
    targets = tokenizer([t for _, t in pairs], padding="max_length", truncation=True, max_length=target_pad_size,
                        return_tensors="pt")
    keep = targets["attention_mask"].long()                        # [B, T]: the target's tokens
    decoder_mask = torch.ones_like(keep)
    decoder_mask[:, 1:] = keep[:, :-1]                             # the start token, then the target's
    return {"input_ids": sources["input_ids"].long(), "attention_mask": sources["attention_mask"].long(),
            "labels": targets["input_ids"].long().masked_fill(keep == 0, IGNORE_INDEX),
            "decoder_attention_mask": decoder_mask}


class Seq2SeqBatches(StepBatches):
    """Global batches of (source, target) pairs, encoded per step by encode_pairs."""

    def __init__(self, pairs, tokenizer, pad_size, target_pad_size, batch_size, shuffle, seed=0, shard=None):
        super().__init__(pairs, batch_size, shuffle, seed, shard)
        self.tokenizer, self.pad_size, self.target_pad_size = tokenizer, pad_size, target_pad_size

    def encode(self, indices):
        return encode_pairs(self.tokenizer, [self.samples[i] for i in indices.tolist()], self.pad_size,
                            self.target_pad_size)
