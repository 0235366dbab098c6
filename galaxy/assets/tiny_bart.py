"""Write a tiny BART checkpoint with a BPE tokenizer trained on Python's own documentation.

    python -m galaxy.assets.tiny_bart models/tiny-bart [--vocab_size 2048] [--seed 0]

Offline stand-in for a real BART (no hub download): galaxy.assets.tiny_llama's byte-level BPE and
special tokens (<pad> 0, <s> 1, </s> 2), every text encoded as BART's are, <s> ... </s>, the
decoder started with </s>; the model is a randomly initialised BartForConditionalGeneration:
width 64, 2 encoder and 2 decoder layers of 4 heads, MLP 128, tied LM head. Both load with
transformers' from_pretrained.
"""
from __future__ import annotations

from galaxy.assets.tiny_llama import SPECIAL, main, train_bpe, with_template, write_tiny_model

TINY_BART_SHAPE = dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                       decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                       max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                       decoder_start_token_id=2, forced_eos_token_id=2)


def bart_tokenizer(bpe):
    """BART's template around a BPE trained with tiny_llama's SPECIAL."""
    return with_template(bpe, "<s> $A </s>", "<s> $A </s> </s> $B </s>", bos_token="<s>", pad_token="<pad>",
                         eos_token="</s>")


def default_tokenizer():
    """The tiny BART's tokenizer (2048 tokens, deterministic): randomly initialised BARTs ship it."""
    return bart_tokenizer(train_bpe(2048, SPECIAL))


def _tiny_bart(**keys):
    from transformers import BartConfig, BartForConditionalGeneration
    return BartForConditionalGeneration(BartConfig(**keys))


def write_tiny_bart(path: str, vocab_size: int = 2048, seed: int = 0, bpe=None) -> str:
    """bpe: a trained tokenizers.Tokenizer with SPECIAL (e.g. models/tiny-llama's); None: train it."""
    def tokenizer(n):
        return bart_tokenizer(bpe or train_bpe(n, SPECIAL))
    return write_tiny_model(path, _tiny_bart, vocab_size, seed, tokenizer=tokenizer, shape=TINY_BART_SHAPE)


if __name__ == "__main__":
    main(write_tiny_bart, __doc__)
