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


TINY_LLAMA = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=4, intermediate_size=96, max_position_embeddings=64,
                  rms_norm_eps=1e-6, attention_dropout=0.0, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2)


def make_tiny_llama(path: str, seed: int = 0, **overrides) -> str:
    """8 query heads sharing 4 K/V heads (grouped-query attention, 2 query heads per group)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, **overrides}))
    with torch.no_grad():   # norm weights away from 1, so every gradient rule is exercised
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


def make_tiny_llama_classifier(path: str, seed: int = 0, num_labels: int = 3, **overrides) -> str:
    """make_tiny_llama's model as HF LlamaForSequenceClassification (its `score` head saved too)."""
    from transformers import LlamaConfig, LlamaForSequenceClassification
    torch.manual_seed(seed)
    model = LlamaForSequenceClassification(LlamaConfig(**{**TINY_LLAMA, **overrides}, num_labels=num_labels))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


def tiny_cls_batch(seed: int, batch: int = 3, seq: int = TINY_SEQ, vocab: int = 128, num_labels: int = 3):
    """tiny_lm_batch's right-padded rows (row i keeps seq - 4*i tokens, pad id 0) with one class
    label per row: the pooled last tokens fall on different sequence shards."""
    out = tiny_lm_batch(seed, batch, seq, vocab)
    out["labels"] = torch.randint(0, num_labels, (batch,), generator=torch.Generator().manual_seed(seed + 1000))
    return out


def tiny_lm_batch(seed: int, batch: int = 3, seq: int = TINY_SEQ, vocab: int = 128):
    """Right-padded causal-LM batch: row i keeps seq - 4*i tokens; labels ignore padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    for i in range(batch):
        mask[i, max(2, seq - 4 * i):] = 0
    ids[mask == 0] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return dict(input_ids=ids, attention_mask=mask, labels=labels)
