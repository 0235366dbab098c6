"""Write a tiny GPT-2 checkpoint with a BPE tokenizer trained on Python's own documentation.

    python -m galaxy.models.tiny_gpt2 models/tiny-gpt2 [--vocab_size 2048] [--seed 0]

Offline stand-in for a real GPT-2 (no hub download): the tokenizer is galaxy.models.tiny_bpe's
byte-level BPE with GPT-2's one special token, <|endoftext|> (id 0: BOS, EOS and, as for GPT-2,
no pad token: galaxy pads with EOS), and no BOS added; the model is a randomly initialised
GPT2LMHeadModel (4 heads, tied LM head, GPT-2's dropouts) saved as safetensors. Both load with
transformers' from_pretrained.
"""
from __future__ import annotations

import argparse
import os

EOT = "<|endoftext|>"


def train_tokenizer(vocab_size: int):
    from transformers import PreTrainedTokenizerFast

    from galaxy.models.tiny_bpe import train_bpe
    return PreTrainedTokenizerFast(tokenizer_object=train_bpe(vocab_size, [EOT]), bos_token=EOT, eos_token=EOT,
                                   unk_token=EOT)


def write_tiny_gpt2(path: str, vocab_size: int = 2048, seed: int = 0) -> str:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    tokenizer = train_tokenizer(vocab_size)
    cfg = GPT2Config(vocab_size=len(tokenizer), n_embd=128, n_layer=4, n_head=4, n_positions=512,
                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    os.makedirs(path, exist_ok=True)
    GPT2LMHeadModel(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--vocab_size", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write_tiny_gpt2(args.path, args.vocab_size, args.seed))
