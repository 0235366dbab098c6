"""Shared pieces of the trainer / checkpoint / export tests.

A tiny BERT with the real MiniLM tokenizer (as in test_entry_scripts.py), pydoc-topics TSV files,
config writing, and `train_on_rank`, which runs the trainer exactly as the entry scripts do but
inside a DistPool worker (module-level, so the pool can pickle it), with matplotlib unimportable:
the trainer skips its loss plot, about 0.5 s of CPU a run (test_trainer_scripts.py draws it).
"""
from __future__ import annotations

import json
import os

import torch.distributed as dist

from support.hidden_modules import modules_hidden
from support.tiny_models import MINILM_TOKENIZER_FILES, make_tiny_bert_with_minilm_tokenizer

CLASSES = ["statements", "expressions", "data-model", "builtin-types", "lexical", "execution"]
TOKENIZER_FILES = MINILM_TOKENIZER_FILES
GALAXY_W2 = dict(att_parallel_method="TP", con_parallel_method="SP", mlp_parallel_method="TP",
                 tp_num_attention_heads_list=[4, 2], tp_intermediate_size_list=[60, 36],
                 seq_scatter_list=[9, 7])


def make_workspace(root, n_train: int = 64, n_held_out: int = 12, **model) -> dict:
    """model/ (tiny BERT, 6 labels, MiniLM tokenizer) and train/dev/test TSV files under root.

    model: BertConfig overrides (e.g. num_hidden_layers=4 for uneven pipeline stages)."""
    from galaxy.data import pydoc_topics_dataset
    root = str(root)
    model_dir = os.path.join(root, "model")
    make_tiny_bert_with_minilm_tokenizer(model_dir, len(CLASSES), **model)
    paths = {"root": root, "model_dir": model_dir}
    for split, n in (("train", n_train), ("dev", n_held_out), ("test", n_held_out)):
        examples, names = pydoc_topics_dataset(split)
        path = os.path.join(root, f"{split}.tsv")
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(f"{text}\t{names[label]}\n" for text, label in examples[:n])
        paths[split] = path
    return paths


def write_config(ws: dict, name: str, **keys) -> str:
    """A config for the workspace: exact (fp32, dropout 0, fixed order) unless keys say otherwise."""
    cfg = dict(model_path=ws["model_dir"], train_path=ws["train"], dev_path=ws["dev"], test_path=ws["test"],
               class_list=CLASSES, pad_size=16, batch_size=8, learning_rate=1e-3, optimizer="adamw",
               shuffle=True, dropout=0.0, timeout_s=60,
               metrics_file=os.path.join(ws["root"], name, "metrics.jsonl"))
    cfg.update(keys)
    path = os.path.join(ws["root"], f"{name}.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path


def train_on_rank(config_path: str, preset: str = "galaxy", before=None, after=None, task: str = "classification"):
    """What an entry script does, on this pool rank (its launch rank: support.dist_pool).

    before / after: optional module-level functions of the trainer, called before and after fit.
    task: "classification" (the BERT scripts), "causal_lm" (the Llama scripts) or "seq2seq" (BART, T5).
    Returns (summary, before(trainer), after(trainer)), None for an absent function.
    """
    import torch
    from galaxy.config import apply_preset, load_config, validate_for_world
    from galaxy.models.shape import read_model_shape
    from galaxy.launch import DistEnv
    from galaxy.train.trainer import ClassifierTrainer, prepare_causal_lm, prepare_classifier, prepare_seq2seq
    from support.dist_pool import launch_rank
    rank, world = launch_rank(), dist.get_world_size()
    cfg = apply_preset(load_config(config_path), preset)
    validate_for_world(cfg, world, rank, read_model_shape(cfg.model_path))
    # a pool placed by another order (or none) than the config's would train another mesh
    assert cfg.plan.position_of(rank) == dist.get_rank(), (rank, dist.get_rank(), cfg.mesh_rank_order)
    prepare = {"classification": prepare_classifier, "causal_lm": prepare_causal_lm, "seq2seq": prepare_seq2seq}
    job = prepare[task](cfg)
    env = DistEnv(rank=dist.get_rank(), world=world, backend="gloo", device=torch.device("cpu"),
                  timeout_s=cfg.timeout_s, local_rank=rank, launch_rank=rank)
    trainer = ClassifierTrainer(job, env)
    early = before(trainer) if before is not None else None
    with matplotlib_hidden():
        summary = trainer.fit()
    return summary, early, (after(trainer) if after is not None else None)


def matplotlib_hidden():
    """`import matplotlib` raises ImportError inside, as if not installed."""
    return modules_hidden(["matplotlib"])


def probe_optimizer_state(trainer):
    """Right after a cross-plan resume: (the saved optimizer tensors, the sliced state gathered
    back); a `before` function for train_on_rank."""
    from galaxy.train.optim_state import gather_optimizer_state
    return trainer.job.resume.optimizer_tensors(), gather_optimizer_state(trainer.model, trainer.optimizer)[0]


def step_losses(metrics_file: str) -> dict[int, float]:
    """{step: loss} of the step records (later records win, as after a resume)."""
    from galaxy.train.metrics import read_metrics
    return {r["step"]: r["loss"] for r in read_metrics(metrics_file) if "event" not in r}
