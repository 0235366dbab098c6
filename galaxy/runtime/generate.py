"""Greedy generation under any plan (no sampling; equals HF generate(do_sample=False)).

Every rank runs the same loop. Each step runs the whole (right-padded) sequence through the
model, so the sequence always has the pad_size length the plan's token shares are made for;
padding after the last real token cannot influence it (causal attention).
"""
from __future__ import annotations

import torch

from galaxy.parallel.full_state import full_sequence_logits


@torch.no_grad()
def greedy_generate(model, tokenizer, prompt: str, max_new_tokens: int, pad_size: int,
                    device="cpu") -> list[int]:
    """Token ids of the continuation (stops after EOS, at max_new_tokens, or at pad_size)."""
    was_training = model.training
    model.eval()
    ids = list(tokenizer(prompt)["input_ids"])
    if len(ids) >= pad_size:
        raise ValueError(f"the prompt has {len(ids)} tokens; pad_size {pad_size} leaves no room to generate")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    new: list[int] = []
    while len(new) < max_new_tokens and len(ids) < pad_size:
        n = len(ids)
        input_ids = torch.tensor([ids + [pad] * (pad_size - n)], device=device)
        mask = torch.tensor([[1] * n + [0] * (pad_size - n)], device=device)
        logits, _ = model(input_ids, attention_mask=mask)
        token = int(full_sequence_logits(model, logits)[0, n - 1].argmax())
        ids.append(token)
        new.append(token)
        if token == tokenizer.eos_token_id:
            break
    model.train(was_training)
    return new
