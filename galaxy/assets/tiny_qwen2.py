"""Write a tiny Qwen2 checkpoint with the BPE tokenizer of galaxy.assets.tiny_llama.

    python -m galaxy.assets.tiny_qwen2 models/tiny-qwen2 [--vocab_size 2048] [--seed 0]

Offline stand-in for a real Qwen2 (no hub download): tiny_llama's tokenizer and shape (4 query
heads sharing 2 K/V heads) as a randomly initialised Qwen2ForCausalLM with tied embeddings (as
Qwen2-0.5B and -1.5B). HF initialises the q/k/v biases to zero; they are drawn here (normal,
std 0.1) so that they change the outputs, as a trained Qwen2's do.
"""
from __future__ import annotations

from galaxy.assets.tiny_llama import main, write_tiny_model


def _tiny_qwen2(**keys):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    # AutoTokenizer loads a qwen2 folder with Qwen2's tokenizer class, which appends <|endoftext|>
    # after the trained vocabulary: the embedding needs that one more row.
    keys["vocab_size"] += 1
    model = Qwen2ForCausalLM(Qwen2Config(**keys, tie_word_embeddings=True))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
                p.normal_(0.0, 0.1)
    return model


def write_tiny_qwen2(path: str, vocab_size: int = 2048, seed: int = 0) -> str:
    return write_tiny_model(path, _tiny_qwen2, vocab_size, seed)


if __name__ == "__main__":
    main(write_tiny_qwen2, __doc__)
