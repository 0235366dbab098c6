#!/usr/bin/env bash
# Set up and run the whole test suite (multi-process tests run on gloo over loopback).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
.venv/bin/python -m pytest tests "$@"
