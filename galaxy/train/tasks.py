"""What a training task brings to the shared trainer: data, batches, evaluation, export metadata.

Three tasks share one trainer (galaxy/train/trainer.py):
  ClassificationTask  BERT sequence classification; mean cross-entropy over the batch's rows
  CausalLMTask        Llama causal LM; mean cross-entropy over the batch's non-ignored label tokens
  Seq2SeqTask         BART, T5; the same over the target's label tokens (not shifted)
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from galaxy.data import ClassificationBatches, load_examples
from galaxy.data.causal_lm import (IGNORE_INDEX, CausalLMBatches, describe_samples, encode_sample, load_lm_samples,
                                   render_samples)
from galaxy.data.seq2seq import Seq2SeqBatches, encode_pairs, load_pairs
from galaxy.parallel.full_state import full_sequence_logits
from galaxy.train.evaluate import evaluate


class ClassificationTask:
    kind = "classification"

    def __init__(self, cfg, tokenizer):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.train_set, self.class_names = load_examples(cfg.train_path, "train", cfg.class_list)
        self.dev_set = self._held_out(cfg.dev_path, "dev")
        self.test_set = self._held_out(cfg.test_path, "test")

    def _held_out(self, path, split):
        """A dev/test set: the given file, or the embedded dataset's split when training on it."""
        if path is None and self.cfg.train_path is not None:
            return None
        return load_examples(path, split, self.class_names)[0]

    @property
    def num_labels(self) -> int:
        return len(self.class_names)

    def batches(self, shard=None):
        c = self.cfg
        return ClassificationBatches(self.train_set, self.tokenizer, c.pad_size, c.batch_size, c.shuffle, c.seed, shard)

    def evaluate(self, model, examples, device, autocast=nullcontext) -> dict:
        return evaluate(model, examples, self.tokenizer, self.cfg.pad_size, self.cfg.batch_size, device, autocast)

    def identity(self) -> dict:
        """What must match for a checkpoint's data position to mean the same thing."""
        return {"class_names": self.class_names, "train_examples": len(self.train_set)}


class CausalLMTask:
    kind = "causal_lm"
    num_labels = None
    class_names = None
    label_shift = 1

    def __init__(self, cfg, tokenizer):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.notes = []      # which formats each data file held (the trainer prints them on rank 0)
        self.train_set = self._load(cfg.train_path, "train")
        embedded = cfg.train_path is None
        self.dev_set = self._load(cfg.dev_path, "dev") if cfg.dev_path or embedded else None
        self.test_set = self._load(cfg.test_path, "test") if cfg.test_path or embedded else None

    def _load(self, path, split):
        samples = load_lm_samples(path, split)
        if path is not None:
            self.notes.append(f"{split} data {describe_samples(path, samples, self.tokenizer)}")
        return render_samples(samples, self.tokenizer)      # chat records: rendered once, here

    def batches(self, shard=None):
        c = self.cfg
        return CausalLMBatches(self.train_set, self.tokenizer, c.pad_size, c.batch_size, c.shuffle, c.seed, shard)

    def encode(self, samples) -> dict:
        """Evaluation rows: input_ids, attention_mask, labels [B, pad_size]."""
        rows = [encode_sample(self.tokenizer, s, self.cfg.pad_size) for s in samples]
        return dict(zip(("input_ids", "attention_mask", "labels"), (torch.stack(t) for t in zip(*rows))))

    @torch.no_grad()
    def evaluate(self, model, samples, device, autocast=nullcontext) -> dict:
        """Token-weighted mean loss, perplexity and next-token accuracy over every sample."""
        was_training = model.training
        model.eval()
        loss_sum, tokens, correct = 0.0, 0, 0
        local = getattr(model, "model", model)   # a runner's own model knows the head's layout
        for start in range(0, len(samples), self.cfg.batch_size):
            batch = {k: v.to(device) for k, v in self.encode(samples[start:start + self.cfg.batch_size]).items()}
            with autocast():
                logits, loss = model(**batch)
            targets = batch["labels"][:, self.label_shift:]        # position t predicts label t + shift
            n = int((targets != IGNORE_INDEX).sum())
            loss_sum += loss.item() * n
            tokens += n
            predicted = full_sequence_logits(local, logits)[:, :targets.shape[1]].argmax(-1)
            correct += int(((predicted == targets) & (targets != IGNORE_INDEX)).sum())
        model.train(was_training)
        loss = loss_sum / max(tokens, 1)
        return {"loss": loss, "perplexity": float(torch.tensor(loss).exp()), "accuracy": correct / max(tokens, 1)}

    def identity(self) -> dict:
        return {"class_names": None, "train_examples": len(self.train_set)}


class Seq2SeqTask(CausalLMTask):
    """BART, T5: (source, target) pairs (galaxy/data/seq2seq.py); the loss and accuracy over the
    target's label tokens, labels aligned to the decoder's positions."""
    kind = "seq2seq"
    label_shift = 0

    def _load(self, path, split):
        pairs = load_pairs(path, split)
        if path is not None:
            self.notes.append(f"{split} data {path}: {len(pairs)} source-target pairs")
        return pairs

    @property
    def target_pad_size(self) -> int:
        return self.cfg.target_pad_size or self.cfg.pad_size

    def batches(self, shard=None):
        c = self.cfg
        return Seq2SeqBatches(self.train_set, self.tokenizer, c.pad_size, self.target_pad_size, c.batch_size,
                              c.shuffle, c.seed, shard)

    def encode(self, samples) -> dict:
        return encode_pairs(self.tokenizer, samples, self.cfg.pad_size, self.target_pad_size)
