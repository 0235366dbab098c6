"""The word embedding's gradient accumulates its looked-up rows in place, micro-batch after micro-batch.

A dense lookup's backward (embedding_dense_backward) makes a fresh [vocab, hidden] gradient every
micro-batch, zeroes it, adds the batch's rows into it, and autograd then adds the whole block
into .grad: all-MiniLM-L6-v2's 30522 x 384 fp32 table is a 47 MB block to zero and add per
micro-batch (4.4 ms on one core), for the few hundred rows a micro-batch touches. Here the lookup
is sparse (nn.Embedding.sparse: its backward is a [tokens, hidden] COO tensor) and .grad is a dense
zero tensor before the step's first backward, so autograd's AccumulateGrad adds each sparse
gradient into it in place (torch/csrc/autograd/functions/accumulate_grad.h, case 2.3: "variable_grad
is dense, and new_grad is sparse" -> variable_grad += new_grad). Optimizers, clipping, Galaxy's
grad sync (its post-accumulate hooks read .grad), DDP's buckets (it copies a dense .grad into its
bucket view at the synchronising backward), the tied-weight sum and checkpoints all see a dense
gradient, as before; padding_idx rows get no gradient in either form.

Where it applies: every nn.Embedding whose rows are the vocabulary (num_embeddings ==
config.vocab_size: BERT's word_embeddings, Llama's embed_tokens, GPT-2's wte, BART / T5's shared),
when
  * the step runs more than one backward (plan.microbatches > 1: gradient accumulation or pipeline
    micro-batches): with one, the zeroed .grad costs what the dense gradient does (memset of the
    same block) and lives through the forward, where the dense one is made at backward's end;
  * it trains (PEFT's frozen embeddings: nothing to accumulate);
  * no other module of this rank uses the same weight: a tied head (GPT-2's lm_head, Llama's
    tie_word_embeddings, T5 / BART's lm_head on one stage) makes a dense gradient of the whole
    table every micro-batch anyway (a pipeline's first stage holds its own copy: that one applies);
  * the replicas are not sharded (dp_sharding with dp > 1): FSDP2 takes no sparse gradients.
GALAXY_EMBEDDING_GRAD=dense in the environment keeps the dense lookup everywhere (for benches that
measure both side by side).
"""
from __future__ import annotations

import os

import torch
from torch import nn


def vocabulary_embeddings(model: nn.Module) -> list[nn.Embedding]:
    """The model's (or stage's) trainable token tables that no other module of it uses."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    tables = {id(m.weight): m for m in model.modules()
              if isinstance(m, nn.Embedding) and m.num_embeddings == vocab and m.weight.requires_grad}
    uses: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            uses[id(p)] = uses.get(id(p), 0) + 1
    return [m for key, m in tables.items() if uses[key] == 1]


def _dense_grad_first(module: nn.Embedding, args) -> None:
    """Forward pre-hook: a dense zero .grad before the step's first backward reaches the table
    (after optimizer.zero_grad(set_to_none=True) it is None: the first sparse gradient would
    become .grad itself)."""
    w = module.weight
    if w.grad is None and torch.is_grad_enabled():
        w.grad = torch.zeros_like(w)


def accumulate_rows_in_place(model: nn.Module, plan, sharded: bool) -> list[nn.Embedding]:
    """Switch the sparse lookup on where it applies (see the module docstring); the tables switched.
    Call after DDP wraps the model: DDP's reducer plans a sparse gradient for an Embedding that is
    sparse when it is built, and .grad here stays dense."""
    if plan.microbatches <= 1 or sharded or os.environ.get("GALAXY_EMBEDDING_GRAD") == "dense":
        return []
    tables = vocabulary_embeddings(model)
    for m in tables:
        m.sparse = True
        m.register_forward_pre_hook(_dense_grad_first)
    return tables
