"""Write a tiny Llama checkpoint with a BPE tokenizer trained on Python's own documentation.

    python -m galaxy.assets.tiny_llama models/tiny-llama [--vocab_size 2048] [--seed 0]

Offline stand-in for a real Llama (no hub download): the tokenizer is a byte-level BPE trained
with the `tokenizers` package on pydoc_data.topics, with <s> (BOS, added by default), </s> (EOS)
and <pad>; the model is a randomly initialised LlamaForCausalLM (grouped-query attention: 4 query
heads sharing 2 K/V heads) saved as safetensors. Both load with transformers' from_pretrained.
"""
from __future__ import annotations

import argparse
import os

SPECIAL = ["<pad>", "<s>", "</s>"]     # ids 0, 1, 2


def train_bpe(vocab_size: int, special_tokens: list[str]):
    """A tokenizers.Tokenizer every tiny checkpoint shares (tiny_llama, tiny_qwen2, tiny_gpt2):
    byte-level pre-tokenizer and decoder (no prefix space), BPE merges learnt from
    pydoc_data.topics; the special tokens take ids 0, 1, ... in the order given."""
    import pydoc_data.topics
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [t for t in pydoc_data.topics.topics.values()]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def with_template(tok, single: str, pair: str, **roles):
    """A transformers tokenizer around a trained BPE (tokenizers.Tokenizer) that wraps every text
    in `single` (e.g. "<s> $A"; `pair` for two texts); roles: bos_token="<s>", ..."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    used = sorted({t for t in (single + " " + pair).split() if t.startswith("<")})
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair,
                                                       special_tokens=[(t, tok.token_to_id(t)) for t in used])
    return PreTrainedTokenizerFast(tokenizer_object=tok, **roles)


def train_tokenizer(vocab_size: int):
    """Llama's (and Qwen2's) tiny tokenizer: SPECIAL, a BOS added before every text."""
    return with_template(train_bpe(vocab_size, SPECIAL), "<s> $A", "<s> $A <s> $B", bos_token="<s>",
                         eos_token="</s>", pad_token="<pad>")


def default_tokenizer():
    """The tiny Llama's tokenizer (2048 tokens, deterministic): randomly initialised Llamas ship it."""
    return train_tokenizer(2048)


# The tiny shape every tiny causal LM shares (galaxy.assets.tiny_qwen2 too), with the ids of SPECIAL.
TINY_SHAPE = dict(hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2)


def write_tiny_model(path: str, make_model, vocab_size: int = 2048, seed: int = 0, *,
                     tokenizer=train_tokenizer, shape: dict = TINY_SHAPE) -> str:
    """Train the tokenizer, seed torch, save make_model(**config keys) and the tokenizer to `path`.

    make_model gets `shape` (TINY_SHAPE unless a family names its sizes otherwise: tiny_gpt2) and
    the tokenizer's vocab_size, and returns a Hugging Face model. tokenizer(vocab_size) builds the
    tokenizer (train_tokenizer: Llama's special tokens).
    """
    import torch
    tokenizer = tokenizer(vocab_size)
    torch.manual_seed(seed)
    os.makedirs(path, exist_ok=True)
    make_model(vocab_size=len(tokenizer), **shape).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_tiny_llama(path: str, vocab_size: int = 2048, seed: int = 0) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM
    return write_tiny_model(path, lambda **keys: LlamaForCausalLM(LlamaConfig(**keys, tie_word_embeddings=False)),
                            vocab_size, seed)


def main(write, doc: str) -> None:
    """The command line of a tiny-model module: PATH [--vocab_size N] [--seed S]."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--vocab_size", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write(args.path, args.vocab_size, args.seed))


if __name__ == "__main__":
    main(write_tiny_llama, __doc__)
