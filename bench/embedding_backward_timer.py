"""pretrain_galaxy.py with the word embedding's backward timed (bench/embedding_grad.py --time_backward).

On the rank holding the vocabulary table (num_embeddings == the config's vocab_size is not known
here: the largest nn.Embedding of over 20000 rows), each micro-batch's time from its output's
gradient (a tensor hook on the lookup's output) to the weight's post-accumulate hook: the lookup's
backward plus AccumulateGrad, dense or rows in place; and each call of embedding_grad's zeroing
pre-hook where it makes .grad. Appended as one JSON line per rank that has the table to the file named by
$EMBGRAD_TIMES at exit:

    {"rank", "engine", "bwd_ms": [per micro-batch], "hook_ms": [per zeroing]}

Run as the testbed's command in place of pretrain_galaxy.py, with the same arguments.
"""
from __future__ import annotations

import atexit
import json
import os
import runpy
import sys
import time

from torch import nn

import galaxy.parallel.embedding_grad as embedding_grad

TABLE_ROWS = 20000
log: dict[str, list[float]] = {"bwd": [], "hook": []}
_start: list[float] = []
_zeroing = embedding_grad._dense_grad_first


def _timed_zeroing(module, args):
    """Times the calls that make .grad (the step's first forward), not those that find it."""
    fresh = module.weight.grad is None
    t0 = time.perf_counter()
    _zeroing(module, args)
    if fresh and module.weight.grad is not None:
        log["hook"].append(time.perf_counter() - t0)


def _after_forward(module, args, out):
    if module.num_embeddings < TABLE_ROWS or not out.requires_grad:
        return
    out.register_hook(lambda g: _start.append(time.perf_counter()))
    if not getattr(module, "_timed", False):
        module._timed = True
        module.weight.register_post_accumulate_grad_hook(
            lambda p: log["bwd"].append(time.perf_counter() - _start.pop()) if _start else None)


def _dump() -> None:
    if not log["bwd"]:
        return
    rank = next((sys.argv[i + 1] for i, a in enumerate(sys.argv[:-1]) if a == "--rank"), "0")
    with open(os.environ["EMBGRAD_TIMES"], "a") as f:
        f.write(json.dumps({"rank": int(rank), "engine": os.environ.get("GALAXY_EMBEDDING_GRAD") or "rows",
                            "bwd_ms": [round(t * 1e3, 3) for t in log["bwd"]],
                            "hook_ms": [round(t * 1e3, 3) for t in log["hook"]]}) + "\n")


def main() -> None:
    embedding_grad._dense_grad_first = _timed_zeroing        # read when build_runner registers it
    nn.modules.module.register_module_forward_hook(
        lambda m, a, out: _after_forward(m, a, out) if isinstance(m, nn.Embedding) else None)
    atexit.register(_dump)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.argv = [os.path.join(root, "pretrain_galaxy.py")] + sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
