#!/usr/bin/env bash
# Quick start: set up, then fine-tune the real all-MiniLM-L6-v2 on the embedded pydoc-topics
# dataset with the Galaxy plan (ATT TP, CON SP, MLP TP, uneven shares) on 2 local processes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
CONFIG=${CONFIG:-train_config/bert/galaxy/full.json}
mkdir -p runs
PORT=$(.venv/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
.venv/bin/python pretrain_galaxy.py --config_file "$CONFIG" --world 2 --rank 1 \
    --init_method "tcp://127.0.0.1:$PORT" > runs/demo_rank1.log 2>&1 &
peer=$!
trap 'kill $peer 2>/dev/null || true' EXIT
.venv/bin/python pretrain_galaxy.py --config_file "$CONFIG" --world 2 --rank 0 --init_method "tcp://127.0.0.1:$PORT"
wait $peer || { echo "rank 1 failed, see runs/demo_rank1.log" >&2; exit 1; }
