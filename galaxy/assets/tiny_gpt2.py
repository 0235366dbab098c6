"""Write a tiny GPT-2 checkpoint with a BPE tokenizer trained on Python's own documentation.

    python -m galaxy.assets.tiny_gpt2 models/tiny-gpt2 [--vocab_size 2048] [--seed 0]

Offline stand-in for a real GPT-2 (no hub download): the tokenizer is galaxy.assets.tiny_llama's
byte-level BPE (train_bpe) with GPT-2's one special token, <|endoftext|> (id 0: BOS, EOS and, as
for GPT-2, no pad token: galaxy pads with EOS), and no BOS added; the model is a randomly
initialised GPT2LMHeadModel (4 heads, tied LM head, GPT-2's dropouts) saved as safetensors. Both
load with transformers' from_pretrained.
"""
from __future__ import annotations

from galaxy.assets.tiny_llama import main, train_bpe, write_tiny_model

EOT = "<|endoftext|>"
# tiny_llama's TINY_SHAPE under GPT-2's names (n_inner None: 4 x n_embd; no grouped K/V).
TINY_GPT2_SHAPE = dict(n_embd=128, n_layer=4, n_head=4, n_positions=512, bos_token_id=0, eos_token_id=0)


def train_tokenizer(vocab_size: int):
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(tokenizer_object=train_bpe(vocab_size, [EOT]), bos_token=EOT, eos_token=EOT,
                                   unk_token=EOT)


def _tiny_gpt2(**keys):
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(**keys))


def write_tiny_gpt2(path: str, vocab_size: int = 2048, seed: int = 0) -> str:
    return write_tiny_model(path, _tiny_gpt2, vocab_size, seed, tokenizer=train_tokenizer, shape=TINY_GPT2_SHAPE)


if __name__ == "__main__":
    main(write_tiny_gpt2, __doc__)
