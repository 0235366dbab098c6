"""Tiny Hugging Face checkpoints written on the fly for fidelity tests."""
from __future__ import annotations

import torch

TINY_BERT = dict(vocab_size=120, hidden_size=48, num_hidden_layers=2, num_attention_heads=6,
                 intermediate_size=96, max_position_embeddings=64, type_vocab_size=2,
                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3)
TINY_SEQ = 12


def make_tiny_bert(path: str, seed: int = 0, **overrides) -> str:
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(seed)
    model = BertForSequenceClassification(BertConfig(**{**TINY_BERT, **overrides}))
    # Non-trivial biases and norm weights, so that every gradient rule is exercised.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


def tiny_batch(seed: int, batch: int = 4, seq: int = TINY_SEQ, vocab: int = 120, num_labels: int = 3):
    """A batch with padding: row i keeps seq - 3*i tokens (at least 2)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    for i in range(batch):
        mask[i, max(2, seq - 3 * i):] = 0
    ids[mask == 0] = 0
    types = (torch.arange(seq) >= seq // 2).long().expand(batch, seq).clone()
    labels = torch.randint(0, num_labels, (batch,), generator=g)
    return dict(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels)
