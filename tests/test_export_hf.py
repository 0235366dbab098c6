"""export_dir: a Hugging Face folder that BertForSequenceClassification loads and that gives the
logits of the galaxy model that was trained (here under the Galaxy plan on 2 ranks)."""
import json
import os

import torch

from support.parity import rel_err
from support.trainer_support import CLASSES, GALAXY_W2, make_workspace, train_on_rank, write_config

PAD = 16


def texts_of(path, n=6):
    with open(path, encoding="utf-8") as f:
        return [line.rsplit("\t", 1)[0] for line in f][:n]


def galaxy_logits(trainer):
    """The trained model's logits on dev texts, as the trainer's own tokenizer encodes them."""
    enc = trainer.job.tokenizer(texts_of(trainer.cfg.dev_path), padding="max_length", truncation=True,
                                max_length=PAD, return_tensors="pt")
    trainer.model.eval()
    with torch.no_grad():
        logits, _ = trainer.model(enc["input_ids"], enc["attention_mask"], enc["token_type_ids"])
    return logits                                       # [6, len(CLASSES)]


def test_export_loads_in_transformers_and_gives_galaxy_logits(dist_pool, tmp_path):
    from transformers import AutoTokenizer, BertForSequenceClassification
    ws = make_workspace(tmp_path, n_train=24)
    out = str(tmp_path / "exported")
    config = write_config(ws, "export", max_steps=3, learning_rate=1e-2, export_dir=out, **GALAXY_W2)
    results = dist_pool(2).run(train_on_rank, config, "galaxy", None, galaxy_logits)
    theirs = results[0][2]

    model = BertForSequenceClassification.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    enc = tokenizer(texts_of(ws["dev"]), padding="max_length", truncation=True, max_length=PAD,
                    return_tensors="pt")
    with torch.no_grad():
        ours = model(**enc).logits
    for rank, (_, _, logits) in enumerate(results):
        assert rel_err(logits, ours) < 1e-5, f"rank {rank}"
    # Training moved the weights away from the starting checkpoint: the export is not a copy of it.
    start = BertForSequenceClassification.from_pretrained(ws["model_dir"]).eval()
    with torch.no_grad():
        assert rel_err(start(**enc).logits, theirs) > 1e-3

    hf_config = json.load(open(os.path.join(out, "config.json")))
    assert hf_config["architectures"] == ["BertForSequenceClassification"]
    assert hf_config["id2label"] == {str(i): name for i, name in enumerate(CLASSES)}
    assert model.config.num_labels == len(CLASSES)
