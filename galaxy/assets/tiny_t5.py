"""Write a tiny T5 checkpoint with a BPE tokenizer trained on Python's own documentation.

    python -m galaxy.assets.tiny_t5 models/tiny-t5 [--vocab_size 2048] [--seed 0]

Offline stand-in for a real T5 (no hub download): galaxy.assets.tiny_llama's byte-level BPE and
special tokens (<pad> 0, </s> 2; <s> unused), every text encoded as T5's are, ... </s>, the
decoder started with <pad>; the model is a randomly initialised T5ForConditionalGeneration in the
v1.0 form: width 64, 2 encoder and 2 decoder layers of 4 heads of 16, ReLU MLP 128, 32 relative
position buckets, the LM head tied to the shared table. Both load with transformers'
from_pretrained.
"""
from __future__ import annotations

from galaxy.assets.tiny_llama import SPECIAL, main, train_bpe, with_template, write_tiny_model

TINY_T5_SHAPE = dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
                     pad_token_id=0, eos_token_id=2, decoder_start_token_id=0)


def t5_tokenizer(bpe):
    """T5's template around a BPE trained with tiny_llama's SPECIAL."""
    return with_template(bpe, "$A </s>", "$A </s> $B </s>", pad_token="<pad>", eos_token="</s>")


def default_tokenizer():
    """The tiny T5's tokenizer (2048 tokens, deterministic): randomly initialised T5s ship it."""
    return t5_tokenizer(train_bpe(2048, SPECIAL))


def _tiny_t5(**keys):
    from transformers import T5Config, T5ForConditionalGeneration
    return T5ForConditionalGeneration(T5Config(**keys))


def write_tiny_t5(path: str, vocab_size: int = 2048, seed: int = 0, bpe=None) -> str:
    """bpe: a trained tokenizers.Tokenizer with SPECIAL (e.g. models/tiny-llama's); None: train it."""
    def tokenizer(n):
        return t5_tokenizer(bpe or train_bpe(n, SPECIAL))
    return write_tiny_model(path, _tiny_t5, vocab_size, seed, tokenizer=tokenizer, shape=TINY_T5_SHAPE)


if __name__ == "__main__":
    main(write_tiny_t5, __doc__)
