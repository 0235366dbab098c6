"""The tokenizer of model_path, refused when it is missing or does not fit the model.

Without its files transformers still builds a BERT tokenizer, with only the 5 special tokens:
every word becomes [UNK] and training runs to the end at chance accuracy. So the files are
required, and the tokenizer's largest id must fit the model's embedding.
"""
from __future__ import annotations

import os

from galaxy.config import ConfigError

# The files that hold a vocabulary, in the formats transformers reads (any one is enough).
VOCABULARY_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "tokenizer.model", "spiece.model",
                    "sentencepiece.bpe.model")


def check_tokenizer_files(model_path: str) -> None:
    if not any(os.path.isfile(os.path.join(model_path, name)) for name in VOCABULARY_FILES):
        raise ConfigError(f"model_path {model_path!r} has no tokenizer (none of {', '.join(VOCABULARY_FILES)}); "
                          "copy the model's tokenizer files next to its config.json "
                          "(tokenizer.save_pretrained(model_path))")


def load_tokenizer(model_path: str):
    """AutoTokenizer.from_pretrained(model_path), checked: files present, ids within the model's
    vocab_size (config.json)."""
    import json

    from transformers import AutoTokenizer
    check_tokenizer_files(model_path)
    with open(os.path.join(model_path, "config.json"), encoding="utf-8") as f:
        vocab_size = json.load(f).get("vocab_size")
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model_path {model_path!r}: its tokenizer cannot be loaded: "
                          f"{' '.join(str(e).split())[:200]}") from None
    largest = max(tokenizer.get_vocab().values(), default=-1)
    if isinstance(vocab_size, int) and largest >= vocab_size:
        raise ConfigError(f"model_path {model_path!r}: the tokenizer has ids up to {largest} but the model's "
                          f"vocab_size is {vocab_size}; the tokenizer belongs to another model, copy the "
                          "right one next to config.json")
    return tokenizer
