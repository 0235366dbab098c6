"""The entry scripts, run as users run them, report HF's serial losses.

A tiny BERT (with the real MiniLM tokenizer) trains 3 SGD steps on a TSV file under
pretrain_bert.py (serial), pretrain_galaxy.py (world 2, uneven shares; and dp 2 x Galaxy 2 at
world 4), pretrain_tp_bert.py (world 2), pretrain_sp_bert.py (world 3), pretrain_dp_bert.py
(world 2, replicas of 6 and 2 rows: dp_batch_list) and pretrain_pp_bert.py (world 2, 4 micro-batches), one process per rank started by
hand. The losses in metrics_file (global-batch means) must equal HF
BertForSequenceClassification trained on the same batches.
"""
import json

import pytest
import torch

from support.script_runner import run_script
from support.tiny_models import make_tiny_bert_with_minilm_tokenizer

from galaxy.data import pydoc_topics_dataset
from galaxy.train.metrics import read_metrics

STEPS, BATCH, PAD, LR = 3, 8, 16, 0.2
CLASSES = ["statements", "expressions", "data-model", "builtin-types", "lexical", "execution"]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("entry")
    model_dir = str(tmp / "model")
    make_tiny_bert_with_minilm_tokenizer(model_dir, len(CLASSES))
    examples, names = pydoc_topics_dataset("train")
    train = tmp / "train.tsv"
    train.write_text("".join(f"{text}\t{names[label]}\n" for text, label in examples[: BATCH * STEPS + 5]))
    return dict(tmp=tmp, model_dir=model_dir, train=str(train))


def write_config(job, name, **extra):
    cfg = dict(model_path=job["model_dir"], train_path=job["train"], class_list=CLASSES, pad_size=PAD,
               batch_size=BATCH, learning_rate=LR, optimizer="sgd", max_steps=STEPS, shuffle=False,
               dropout=0.0, timeout_s=60, metrics_file=str(job["tmp"] / f"{name}.jsonl"), **extra)
    path = job["tmp"] / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return str(path), cfg["metrics_file"]


_HF_LOSSES: dict = {}       # model folder -> HF's losses: the same reference for every script


def hf_losses(job):
    from transformers import BertForSequenceClassification
    if job["model_dir"] not in _HF_LOSSES:
        _HF_LOSSES[job["model_dir"]] = sgd_losses(BertForSequenceClassification.from_pretrained(job["model_dir"]), job)
    return list(_HF_LOSSES[job["model_dir"]])


def sgd_losses(model, job, steps=STEPS, batch=BATCH, pad=PAD, lr=LR):
    """A Hugging Face classifier's losses under SGD over its trainable parameters, on the job's
    rows in order, tokenized as the entry scripts tokenize them."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(job["model_dir"])
    rows = [line.rsplit("\t", 1) for line in open(job["train"]).read().splitlines()]
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for step in range(steps):
        chunk = rows[step * batch:(step + 1) * batch]
        enc = tok([t for t, _ in chunk], padding="max_length", truncation=True, max_length=pad, return_tensors="pt")
        loss = model(**enc, labels=torch.tensor([CLASSES.index(y) for _, y in chunk])).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("script,world,extra", [
    ("pretrain_bert.py", 1, {}),
    ("pretrain_galaxy.py", 2, dict(att_parallel_method="TP", con_parallel_method="SP", mlp_parallel_method="TP",
                                   tp_num_attention_heads_list=[4, 2], tp_intermediate_size_list=[60, 36],
                                   seq_scatter_list=[9, 7])),
    ("pretrain_tp_bert.py", 2, {}),
    ("pretrain_sp_bert.py", 3, dict(seq_scatter_list=[7, 5, 4])),
    ("pretrain_dp_bert.py", 2, dict(dp_batch_list=[6, 2])),
    ("pretrain_pp_bert.py", 2, dict(stage_num_hidden_layers_list=[1, 1], num_microbatches=4)),
    ("pretrain_galaxy.py", 4, dict(dp_deg=2, tp_num_attention_heads_list=[4, 2], seq_scatter_list=[9, 7])),
], ids=["serial", "galaxy-w2", "tp-w2", "sp-w3", "dp-w2-uneven", "pp-w2", "dp2xgalaxy2-w4"])
def test_script_reports_hf_losses(job, script, world, extra):
    config, metrics_file = write_config(job, f"{script.removesuffix('.py')}-w{world}", **extra)
    run_script(script, config, world)
    records = read_metrics(metrics_file)
    steps = [r for r in records if "step" in r and "event" not in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert all(set(r) == {"step", "loss", "lr", "tokens", "time_s"} for r in steps)
    assert records[-1]["event"] == "done"
    want = hf_losses(job)
    for r, ref in zip(steps, want):
        assert abs(r["loss"] - ref) <= 1e-5 * abs(ref), (r["loss"], ref)
