"""Write a tiny Llama checkpoint with a BPE tokenizer trained on Python's own documentation.

    python -m galaxy.models.tiny_llama models/tiny-llama [--vocab_size 2048] [--seed 0]

Offline stand-in for a real Llama (no hub download): the tokenizer is a byte-level BPE trained
with the `tokenizers` package on pydoc_data.topics, with <s> (BOS, added by default), </s> (EOS)
and <pad>; the model is a randomly initialised LlamaForCausalLM (grouped-query attention: 4 query
heads sharing 2 K/V heads) saved as safetensors. Both load with transformers' from_pretrained.
"""
from __future__ import annotations

import argparse
import os

SPECIAL = ["<pad>", "<s>", "</s>"]     # ids 0, 1, 2


def train_tokenizer(vocab_size: int):
    import pydoc_data.topics
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [t for t in pydoc_data.topics.topics.values()]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def default_tokenizer():
    """The tiny Llama's tokenizer (2048 tokens, deterministic): randomly initialised Llamas ship it."""
    return train_tokenizer(2048)


def write_tiny_llama(path: str, vocab_size: int = 2048, seed: int = 0) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    tokenizer = train_tokenizer(vocab_size)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    os.makedirs(path, exist_ok=True)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--vocab_size", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write_tiny_llama(args.path, args.vocab_size, args.seed))
