"""Time one training step of a galaxy serial model against Hugging Face, side by side.

One training step = zero_grad, forward (with loss), backward, AdamW step. Both models hold
identical weights and run on the same batch, in the same process with the same torch thread
count, both in train() mode with the same dropout:

* --model bert (default): all-MiniLM-L6-v2 (models/all-MiniLM-L6-v2) as a classifier; galaxy's
  freshly initialised classifier is copied into HF's BertForSequenceClassification (default
  attention = sdpa); real sentences (pydoc topics paragraphs, padded to --pad_size).
* --model bart | t5: a t5-small-shaped BartForConditionalGeneration / T5ForConditionalGeneration
  (d_model 512, 6 + 6 layers, 8 heads, MLP 2048, vocabulary 32128; T5 v1.0: ReLU MLP, tied head),
  randomly initialised by Hugging Face, saved to a temporary folder that both load; the
  embedded seq2seq dataset (a pydoc topic's text -> its title) with the tiny model's tokenizer,
  source rows of --pad_size, targets of --target_pad_size (labels -100 on padding).

After --warmup steps each, measurements are interleaved (galaxy, HF, HF, galaxy, ...) so machine
noise hits both alike. Prints median / min step time per model, the galaxy/HF ratios and a
PASS/FAIL line against the target (galaxy / HF of medians <= 1.05).

    HF_HUB_OFFLINE=1 .venv/bin/python bench/step_time_vs_hf.py [--model bert|bart|t5] [--threads 2] [--json out.json]
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
from transformers import AutoTokenizer, BertForSequenceClassification  # noqa: E402

from galaxy.distributed.group import GalaxyGroup  # noqa: E402
from galaxy.models.build import load_hf_config  # noqa: E402
from galaxy.runtime.assemble import build_model  # noqa: E402
from galaxy.plan import Plan  # noqa: E402

TARGET = 1.05
NUM_LABELS = 4
# t5-small's shapes, used for both encoder-decoders (bart-base is 768 wide: too slow on 2 cores)
ENCDEC_SHAPES = {
    "bart": {"d_model": 512, "encoder_layers": 6, "decoder_layers": 6, "encoder_attention_heads": 8,
             "decoder_attention_heads": 8, "encoder_ffn_dim": 2048, "decoder_ffn_dim": 2048,
             "vocab_size": 32128, "max_position_embeddings": 512},
    "t5": {"d_model": 512, "num_layers": 6, "num_decoder_layers": 6, "num_heads": 8, "d_kv": 64,
           "d_ff": 2048, "vocab_size": 32128, "feed_forward_proj": "relu"},
}


def make_batch(model_dir: str, batch_size: int, pad_size: int) -> dict[str, torch.Tensor]:
    """Real sentences: the first paragraphs of Python's pydoc topics, of varied length."""
    from pydoc_data.topics import topics
    paras = [" ".join(p.split()) for text in topics.values() for p in text.split("\n\n")]
    paras = [p for p in paras if len(p) > 40]
    texts = [paras[i * 7][: 60 + 90 * i] for i in range(batch_size)]    # short and long ones
    tok = AutoTokenizer.from_pretrained(model_dir)
    enc = tok(texts, padding="max_length", truncation=True, max_length=pad_size, return_tensors="pt")
    labels = torch.arange(batch_size) % NUM_LABELS
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
            "token_type_ids": enc["token_type_ids"], "labels": labels}


def bert_pair(args):
    cfg = load_hf_config(args.model_dir, args.dropout)
    group = GalaxyGroup.serial(cfg.num_attention_heads, cfg.intermediate_size, args.pad_size)
    galaxy = build_model(args.model_dir, Plan(), group, num_labels=NUM_LABELS, seed=0, dropout=args.dropout)
    cfg.num_labels = NUM_LABELS
    hf = BertForSequenceClassification.from_pretrained(args.model_dir, config=cfg)
    with torch.no_grad():
        hf.classifier.weight.copy_(galaxy.classifier.weight)
        hf.classifier.bias.copy_(galaxy.classifier.bias)
    return galaxy, hf, make_batch(args.model_dir, args.batch_size, args.pad_size)


def encdec_pair(args, folder: str):
    """A t5-small-shaped model of args.model written by Hugging Face to `folder`, loaded by both."""
    from transformers import (BartConfig, BartForConditionalGeneration, T5Config,
                              T5ForConditionalGeneration)
    from galaxy.data.seq2seq import encode_pairs, load_pairs
    tiny = str(ROOT / "models" / f"tiny-{args.model}")
    tok = AutoTokenizer.from_pretrained(tiny)
    special = {k: getattr(tok, k) for k in ("pad_token_id", "eos_token_id")}
    config_cls, model_cls = ((BartConfig, BartForConditionalGeneration) if args.model == "bart"
                             else (T5Config, T5ForConditionalGeneration))
    start = load_hf_config(tiny).decoder_start_token_id
    config = config_cls(**ENCDEC_SHAPES[args.model], **special, decoder_start_token_id=start)
    model_cls(config).save_pretrained(folder)
    cfg = load_hf_config(folder, args.dropout)
    heads = cfg.encoder_attention_heads if args.model == "bart" else cfg.num_heads
    ffn = cfg.encoder_ffn_dim if args.model == "bart" else cfg.d_ff
    galaxy = build_model(folder, Plan(), GalaxyGroup.serial(heads, ffn, args.pad_size), seed=0,
                         dropout=args.dropout, task="seq2seq")
    hf = model_cls.from_pretrained(folder, config=cfg)
    pairs = load_pairs(None, "train")[: args.batch_size]
    batch = encode_pairs(tok, pairs, args.pad_size, args.target_pad_size)
    return galaxy, hf, batch


def dropout_of(config) -> float:
    for key in ("hidden_dropout_prob", "dropout", "dropout_rate"):     # BERT, BART, T5
        if hasattr(config, key):
            return getattr(config, key)
    raise KeyError("no dropout key in the config")


def galaxy_loss(model, batch):
    return model(**batch)[1]


def hf_loss(model, batch):
    return model(**batch).loss


def step(model, loss_fn, opt, batch) -> float:
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss_fn(model, batch).backward()
    opt.step()
    return time.perf_counter() - t0


def main() -> None:
    from galaxy.train.optim import build_optimizer
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=("bert", "bart", "t5"), default="bert")
    ap.add_argument("--target_pad_size", type=int, default=32, help="bart, t5: target tokens per row")
    ap.add_argument("--model_dir", default=str(ROOT / "models" / "all-MiniLM-L6-v2"))
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--pad_size", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--dropout", type=float, default=None, help="default: the checkpoint's")
    ap.add_argument("--json", default=None, help="write the figures to this file")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        galaxy, hf, batch = (bert_pair(args) if args.model == "bert" else encdec_pair(args, folder))
    pad_frac = 1 - batch["attention_mask"].float().mean().item()

    # Honesty check: same weights, same batch -> same loss (dropout off for the check).
    galaxy.eval(), hf.eval()
    with torch.no_grad():
        lg, lh = galaxy_loss(galaxy, batch).item(), hf_loss(hf, batch).item()
    galaxy.train(), hf.train()

    runs = {"galaxy": (galaxy, galaxy_loss), "hf": (hf, hf_loss)}
    opts = {k: build_optimizer("adamw", m.parameters(), lr=1e-5) for k, (m, _) in runs.items()}
    for _ in range(args.warmup):
        for k, (m, fn) in runs.items():
            step(m, fn, opts[k], batch)
    times = {k: [] for k in runs}
    for i in range(args.steps):   # interleaved, and alternate who goes first
        for k in (("galaxy", "hf") if i % 2 == 0 else ("hf", "galaxy")):
            m, fn = runs[k]
            times[k].append(step(m, fn, opts[k], batch))

    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    low = {k: min(v) * 1e3 for k, v in times.items()}
    ratio_med, ratio_min = med["galaxy"] / med["hf"], low["galaxy"] / low["hf"]
    # Neighbouring steps share the machine's state: the median of per-pair ratios resists bursts.
    ratio_pair = statistics.median(g / h for g, h in zip(times["galaxy"], times["hf"]))
    print(f"{args.model}: torch {torch.__version__}, threads {torch.get_num_threads()}, batch {args.batch_size} x "
          f"{args.pad_size} ({pad_frac:.0%} padding), dropout "
          f"{dropout_of(hf.config)}, {args.steps} steps after {args.warmup} warm-up")
    print(f"loss check (eval): galaxy {lg:.6f}  hf {lh:.6f}  |diff| {abs(lg - lh):.2e}")
    for k in runs:
        print(f"{k:>7}: median {med[k]:8.2f} ms   min {low[k]:8.2f} ms")
    print(f"galaxy / HF: median {ratio_med:.3f}   min {ratio_min:.3f}   paired median {ratio_pair:.3f}")
    ok = ratio_med <= TARGET
    print(f"{'PASS' if ok else 'FAIL'}: galaxy / HF (median) {ratio_med:.3f} {'<=' if ok else '>'} {TARGET}")
    if args.json:
        out = {"model": args.model, "target_pad_size": args.target_pad_size if args.model != "bert" else None,
               "threads": torch.get_num_threads(), "batch_size": args.batch_size,
               "pad_size": args.pad_size, "steps": args.steps, "warmup": args.warmup,
               "dropout": dropout_of(hf.config), "padding_fraction": pad_frac,
               "loss_galaxy": lg, "loss_hf": lh, "median_ms": med, "min_ms": low,
               "ratio_median": ratio_med, "ratio_min": ratio_min,
               "ratio_paired_median": ratio_pair, "target": TARGET, "pass": ok,
               "times_ms": {k: [t * 1e3 for t in v] for k, v in times.items()}}
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
