"""The word embedding's rows accumulate into a dense .grad in place (galaxy.parallel.embedding_grad).

After m micro-batches its gradient equals the dense lookup's (torch's own embedding backward, a
fresh [vocab, hidden] block per micro-batch added into .grad) to rounding, on BERT (padding_idx 0,
padded rows) and on GPT-2, whose LM head is tied to wte: on one stage the tied table stays dense, on
a pipeline's first stage its own copy switches. The optimizer (AdamW, which refuses sparse
gradients) steps on a dense .grad, and the next step's zero_grad(set_to_none) does not bring a
sparse one back.
"""
import os
from dataclasses import replace

import pytest
import torch
from torch import nn

from support.tiny_models import TINY_SEQ, GPT2_INTERMEDIATE, tiny_batch, tiny_lm_batch

from galaxy.distributed.mesh import make_mesh
from galaxy.parallel.embedding_grad import accumulate_rows_in_place, vocabulary_embeddings
from galaxy.plan import Plan
from galaxy.runtime.runners import build_runner

GALAXY = Plan.preset("galaxy")


def _two_steps(model_dir, plan, batch_fn, dense: bool):
    """Two steps of `plan` (AdamW between them): (names of the switched tables, every gradient after
    each step, each gradient's layout)."""
    os.environ["GALAXY_EMBEDDING_GRAD"] = "dense" if dense else ""
    try:
        runner = build_runner(model_dir, plan, make_mesh(plan), num_labels=3)
    finally:
        del os.environ["GALAXY_EMBEDDING_GRAD"]
    names = {id(m): n for n, m in runner.model.named_modules()}
    switched = sorted(names[id(m)] for m in runner.model.modules() if isinstance(m, nn.Embedding) and m.sparse)
    opt = torch.optim.AdamW(runner.parameters(), lr=1e-3)
    grads, layouts = [], set()
    for step in range(2):
        runner.step(batch_fn(seed=step))
        grads.append({n: p.grad.clone() for n, p in runner.named_parameters() if p.grad is not None})
        layouts |= {p.grad.layout for p in runner.parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad(set_to_none=True)
    return switched, grads, layouts


def _bert_batch(seed):
    return tiny_batch(seed=seed, batch=6)


def _gpt2_batch(seed):
    return tiny_lm_batch(seed=seed, batch=4)


CASES = [  # (family, pp, Galaxy shares, micro-batches, tables switched on each rank)
    ("bert", 1, ((4, 2), (64, 32), (7, 5)), 3, ["embeddings.word_embeddings"] * 2),
    ("bert", 2, ((6,), (96,), (TINY_SEQ,)), 3, [["embeddings.word_embeddings"], []]),
    ("gpt2", 2, ((4,), (GPT2_INTERMEDIATE,), (TINY_SEQ,)), 2, [["wte"], []]),
    ("gpt2", 1, ((2, 2), (96, 96), (6, 6)), 2, [[], []]),        # wte is lm_head's weight: dense
]


@pytest.mark.parametrize("family,pp,shares,m,tables", CASES, ids=[f"{c[0]}-pp{c[1]}" for c in CASES])
def test_rows_in_place_equal_the_dense_gradients(dist_pool, tiny_bert_dir, tiny_lm_dir, family, pp, shares, m, tables):
    model_dir, batch_fn = (tiny_bert_dir, _bert_batch) if family == "bert" else (tiny_lm_dir("gpt2"), _gpt2_batch)
    heads, columns, tokens = shares
    plan = replace(GALAXY, pp=pp, heads=heads, columns=columns, tokens=tokens,
                   stages=(2,) if pp == 1 else (1, 1), microbatches=m)
    pool = dist_pool(2)
    dense = pool.run(_two_steps, model_dir, plan, batch_fn, True)
    rows = pool.run(_two_steps, model_dir, plan, batch_fn, False)
    for rank, ((_, ref, _), (switched, got, layouts), want) in enumerate(zip(dense, rows, tables)):
        want = want if isinstance(want, list) else [want]
        assert switched == want, (rank, switched)
        assert layouts == {torch.strided}, (rank, layouts)
        for step in range(2):
            assert got[step].keys() == ref[step].keys()
            for name, g in ref[step].items():
                err = ((got[step][name] - g).abs().max() / g.abs().max().clamp_min(1e-30)).item()
                assert err < 1e-6, (rank, step, name, err)


def test_one_micro_batch_sharded_or_frozen_keeps_the_dense_lookup():
    """Rows in place only where a step runs several backwards through a trainable, untied table
    whose replicas FSDP does not shard."""
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = type("C", (), {"vocab_size": 10})()
            self.emb, self.pos, self.head = nn.Embedding(10, 4), nn.Embedding(10 + 6, 4), nn.Linear(4, 10)

    model = Tied()
    assert vocabulary_embeddings(model) == [model.emb]          # pos: not the vocabulary's rows
    assert accumulate_rows_in_place(model, replace(GALAXY, microbatches=1), sharded=False) == []
    assert accumulate_rows_in_place(model, replace(GALAXY, microbatches=4), sharded=True) == []
    model.head.weight = model.emb.weight                          # tied: the head's gradient is dense anyway
    assert vocabulary_embeddings(model) == []
    model = Tied()
    model.emb.weight.requires_grad_(False)                       # PEFT: frozen
    assert vocabulary_embeddings(model) == []
    model = Tied()
    assert accumulate_rows_in_place(model, replace(GALAXY, microbatches=4), sharded=False) == [model.emb]
    ids = torch.tensor([[1, 2, 2, 0]])
    model.emb(ids).sum().backward()
    assert model.emb.weight.grad.layout == torch.strided
    assert model.emb.weight.grad[2].tolist() == [2.0] * 4 and model.emb.weight.grad[3].tolist() == [0.0] * 4
