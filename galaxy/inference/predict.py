"""Classifier predictions instead of training: `--predict FILE [--out FILE.jsonl]` on the
classification scripts (pretrain_*.py; finetune_llama.py with task classification), or
`"train": false` in the config (Galaxy-LM's key), which predicts the test set.

The model is the one training would start from (model_path, or the checkpoint `resume` names, with
the config's PEFT method), under the config's plan and mesh (galaxy.runtime.runners: a pipeline's
stages, the Galaxy group's shares); every rank runs every batch, as evaluation does. Inputs are
the classification data formats (TSV, CSV, JSONL) with the label optional. Rank 0 writes one JSON
line per input, in order: {"text", "label": the predicted class name, "probabilities": [one per
class, in class_list order]}, to --out or stdout, and prints the accuracy on stderr when every
input has a label. The class names are class_list, else those the training data gives (the
trainer's: an export's labels follow them).
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import torch

from galaxy.config import ConfigError
from galaxy.data import load_examples
from galaxy.data.readers import read_inputs
from galaxy.files import write_text_atomic
from galaxy.inference.setup import checked_model
from galaxy.models.weights import read_hf_state_dict
from galaxy.peft import PeftOptions, apply_peft
from galaxy.preflight.paths import check_writable
from galaxy.preflight.tokenizer import load_tokenizer
from galaxy.runtime.runners import build_runner, plan_and_mesh
from galaxy.train.checkpoint import Checkpoint, resolve_resume
from galaxy.train.trainer import prepare_classifier, train_classifier


def add_predict_arguments(p) -> None:
    p.add_argument("--predict", metavar="FILE", help="classify FILE's texts (TSV, CSV or JSONL; labels optional) "
                                                     "instead of training")
    p.add_argument("--out", metavar="FILE.jsonl", help="with --predict or train false: write the predictions here "
                                                       "(default: print them)")


@dataclass
class PredictJob:
    cfg: object
    tokenizer: object
    shape: dict
    class_names: list[str]
    inputs: list[tuple[str, int | None]]
    resume: Checkpoint | None
    peft: PeftOptions
    out: str | None

    @property
    def num_labels(self) -> int:
        return len(self.class_names)

    @property
    def what(self) -> str:
        return f"predict {len(self.inputs)} inputs in {self.num_labels} classes"


def wants_prediction(cfg, args) -> bool:
    return getattr(args, "predict", None) is not None or not cfg.train


def prepare_classify(cfg, args):
    """A classification script's job: training (galaxy.train.trainer), or predictions."""
    return prepare_predict(cfg, args) if wants_prediction(cfg, args) else prepare_classifier(cfg)


def run_classify(job, env):
    return run_predict(job, env) if isinstance(job, PredictJob) else train_classifier(job, env)


def prepare_predict(cfg, args, script_task: str = "classification") -> PredictJob:
    """script_task: the task the script trains when the config names none."""
    if (cfg.task or script_task) != "classification":
        raise ConfigError(f"train false and --predict classify, but this run's task is {cfg.task or script_task}: "
                          "set task to classification, or run generate.py for a causal LM")
    shape, peft = checked_model(cfg, "classification")
    tokenizer = load_tokenizer(cfg.model_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token      # as training pads a decoder's rows
    names = cfg.class_list if cfg.class_list is not None else load_examples(cfg.train_path, "train")[1]
    if args.predict is not None:
        inputs = read_inputs(args.predict, names)
    else:
        inputs = load_examples(cfg.test_path, "test", names)[0]
    if args.out is not None:
        check_writable("--out", args.out, "file")
    return PredictJob(cfg, tokenizer, shape, list(names), inputs, resolve_resume(cfg.resume, cfg.save_dir), peft,
                      args.out)


@torch.no_grad()
def run_predict(job: PredictJob, env) -> list[dict]:
    cfg = job.cfg
    torch.manual_seed(cfg.seed)
    plan, mesh = plan_and_mesh(cfg, env.world, job.shape)
    source = job.resume.model_dir if job.resume else cfg.model_path
    # PEFT weights of a resumed checkpoint are in its model folder, as training resumes them.
    state = read_hf_state_dict(source) if job.resume and job.peft.method != "full" else None
    runner = build_runner(source, plan, mesh, num_labels=job.num_labels, seed=cfg.seed, device=env.device,
                          task="classification", adapt=lambda m: apply_peft(m, job.peft, seed=cfg.seed, state=state))
    runner.eval()
    records = []
    for start in range(0, len(job.inputs), cfg.batch_size):
        chunk = job.inputs[start:start + cfg.batch_size]
        enc = job.tokenizer([t for t, _ in chunk], padding="max_length", truncation=True, max_length=cfg.pad_size,
                            return_tensors="pt")
        types = enc.get("token_type_ids")
        logits, _ = runner(enc["input_ids"].to(env.device), enc["attention_mask"].to(env.device),
                           None if types is None else types.to(env.device))             # [b, classes]
        for (text, _), p in zip(chunk, torch.softmax(logits.float(), -1).tolist()):
            records.append({"text": text, "label": job.class_names[max(range(len(p)), key=p.__getitem__)],
                            "probabilities": p})
    if env.rank == 0:
        report(job, records)
    return records


def report(job: PredictJob, records: list[dict]) -> None:
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    if job.out is None:
        sys.stdout.write(lines)
        sys.stdout.flush()
    else:
        write_text_atomic(job.out, lines)
    labels = [y for _, y in job.inputs]
    if all(y is not None for y in labels):
        right = sum(job.class_names[y] == r["label"] for y, r in zip(labels, records))
        sys.stderr.write(f"accuracy {right / len(records):.4f} ({right} of {len(records)})"
                         + (f"; wrote {job.out}" if job.out else "") + "\n")
    elif job.out:
        sys.stderr.write(f"wrote {len(records)} predictions to {job.out}\n")
