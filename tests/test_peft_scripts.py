"""PEFT through the entry scripts: LoRA under the Galaxy plan (world 2, uneven shares) reports
the serial LoRA run's losses, and its exported peft adapter, loaded with PeftModel onto HF's
model, reproduces the trained model's logits; a bad PEFT config is a one-line exit 2."""
import json

import pytest
import torch

from support.script_runner import run_script, run_scripts
from support.tiny_models import make_tiny_bert_with_minilm_tokenizer

from galaxy.data import pydoc_topics_dataset
from galaxy.train.metrics import read_metrics

STEPS, BATCH, PAD = 3, 8, 16
CLASSES = ["statements", "expressions", "data-model", "builtin-types", "lexical", "execution"]
LORA = dict(use_lora=True, lora_dim=4, lora_alpha=8, lora_target_modules=["query", "value", "dense"])


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("peft_entry")
    model_dir = str(tmp / "model")
    make_tiny_bert_with_minilm_tokenizer(model_dir, len(CLASSES))
    examples, names = pydoc_topics_dataset("train")
    train = tmp / "train.tsv"
    train.write_text("".join(f"{t}\t{names[y]}\n" for t, y in examples[: BATCH * STEPS]))
    return dict(tmp=tmp, model_dir=model_dir, train=str(train))


def write_config(job, name, **extra):
    cfg = dict(model_path=job["model_dir"], train_path=job["train"], class_list=CLASSES, pad_size=PAD,
               batch_size=BATCH, learning_rate=0.3, optimizer="sgd", max_steps=STEPS, shuffle=False,
               dropout=0.0, timeout_s=60, metrics_file=str(job["tmp"] / f"{name}.jsonl"))
    cfg.update(extra)
    path = job["tmp"] / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return str(path), cfg["metrics_file"]


def losses(path):
    return [r["loss"] for r in read_metrics(path) if "event" not in r]


def test_galaxy_lora_equals_serial_lora_and_exports_a_peft_adapter(job):
    from peft import PeftModel
    from transformers import AutoTokenizer, BertForSequenceClassification

    from galaxy.distributed.group import GalaxyGroup
    from galaxy.runtime.assemble import build_model
    from galaxy.plan import Plan
    from galaxy.peft import PeftOptions, apply_peft
    config, serial_metrics = write_config(job, "lora-serial", **LORA)
    run_script("pretrain_bert.py", config, 1)
    export = str(job["tmp"] / "adapter")
    config, galaxy_metrics = write_config(job, "lora-galaxy", **LORA, export_dir=export,
                                          tp_num_attention_heads_list=[4, 2], tp_intermediate_size_list=[60, 36],
                                          seq_scatter_list=[9, 7])
    run_script("pretrain_galaxy.py", config, 2)
    serial, galaxy = losses(serial_metrics), losses(galaxy_metrics)
    assert len(galaxy) == STEPS
    assert max(abs(a - b) / abs(b) for a, b in zip(galaxy, serial)) < 1e-5

    tok = AutoTokenizer.from_pretrained(job["model_dir"])
    enc = tok(["for x in y: pass", "a lambda expression"], padding="max_length", max_length=PAD,
              truncation=True, return_tensors="pt")
    hf = PeftModel.from_pretrained(BertForSequenceClassification.from_pretrained(job["model_dir"]), export).eval()
    ours = build_model(job["model_dir"], Plan(), GalaxyGroup.serial(6, 96, PAD), num_labels=len(CLASSES))
    apply_peft(ours, PeftOptions("lora", lora_path=export))
    ours.eval()
    with torch.no_grad():
        want = hf(**enc).logits
        got, _ = ours(enc["input_ids"], enc["attention_mask"], enc["token_type_ids"])
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5


def test_two_peft_methods_are_a_one_line_exit_2(job):
    config, _ = write_config(job, "two-methods", use_lora=True, use_adapter=True)
    # on a command driver (exit 2 comes before any process group or model, and keeps the driver)
    ((code, out, err),), = run_scripts([("pretrain_bert.py", config, 1)])
    assert code == 2 and "use_lora and use_adapter" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("method", ["use_side", "use_side_only"])
def test_pipelined_side_tuning_equals_serial(job, method):
    """pretrain_pp_bert.py (2 stages, 2 micro-batches) with side-tuning reports the serial run's
    losses, and its summary counts the whole model's parameters, not one stage's."""
    side = {method: True, "side_reduction_factor": 4}
    config, serial_metrics = write_config(job, f"{method}-serial", **side)
    serial_out = run_script("pretrain_bert.py", config, 1)
    config, pp_metrics = write_config(job, f"{method}-pp", **side, num_microbatches=2)
    pp_out = run_script("pretrain_pp_bert.py", config, 2)
    serial, pipelined = losses(serial_metrics), losses(pp_metrics)
    assert len(pipelined) == STEPS
    assert max(abs(a - b) / abs(b) for a, b in zip(pipelined, serial)) < 1e-5
    counts = [next(line for line in out[0].splitlines() if line.startswith("parameters:"))
              for out in (serial_out, pp_out)]
    assert counts[0] == counts[1], counts
