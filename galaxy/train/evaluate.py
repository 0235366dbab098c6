"""Loss and accuracy of a classifier on a labelled set (every example, last batch included).

Every rank of the Galaxy group runs every batch (the plan needs all of them for each forward)
and gets the same numbers.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F


@torch.no_grad()
def evaluate(model, examples, tokenizer, pad_size: int, batch_size: int, device,
             autocast=nullcontext) -> dict:
    was_training = model.training
    model.eval()
    total_loss, correct = 0.0, 0
    for start in range(0, len(examples), batch_size):
        chunk = examples[start:start + batch_size]
        enc = tokenizer([t for t, _ in chunk], padding="max_length", truncation=True,
                        max_length=pad_size, return_tensors="pt")
        labels = torch.tensor([y for _, y in chunk], device=device)            # [b]
        types = enc.get("token_type_ids")
        with autocast():
            logits, _ = model(enc["input_ids"].to(device), enc["attention_mask"].to(device),
                              None if types is None else types.to(device))     # [b, classes]
        total_loss += F.cross_entropy(logits.float(), labels, reduction="sum").item()
        correct += (logits.argmax(-1) == labels).sum().item()
    model.train(was_training)
    n = max(len(examples), 1)
    return {"loss": total_loss / n, "accuracy": correct / n}
