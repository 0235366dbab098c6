"""Dropout follows the activation layout (docs/design.md section 3).

Replicated activations: every rank of the group draws the same mask, so the default random
stream must stay in lockstep across ranks through a training step with dropout on. Sharded
activations: each rank draws its own mask.
"""
import hashlib
import itertools

import pytest
import torch
import torch.distributed as dist

from support.parity import world_group
from support.tiny_models import tiny_batch

from galaxy.layers.rng import ShardedRNG
from galaxy.runtime.assemble import build_model
from galaxy.plan import Plan

COMBOS = list(itertools.product(("TP", "SP"), ("TP", "SP"), ("SP", "None")))


def training_step_with_dropout(model_dir, att, mlp, con):
    torch.manual_seed(7)
    group = world_group((4, 2), (64, 32), (7, 5))
    model = build_model(model_dir, Plan(att, mlp, con), group, num_labels=3, seed=7, dropout=0.3)
    model.train()
    logits, loss = model(**tiny_batch(seed=0))
    loss.backward()
    state = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()
    return state, logits.detach()


def sharded_stream_masks():
    rng = ShardedRNG(seed=3, rank=dist.get_rank(), device=torch.device("cpu"))
    torch.manual_seed(3)
    with rng.fork():
        sharded = torch.nn.functional.dropout(torch.ones(64), 0.5, True)
    replicated = torch.nn.functional.dropout(torch.ones(64), 0.5, True)
    return sharded, replicated


@pytest.mark.parametrize("att,mlp,con", COMBOS, ids=[f"att{a}-mlp{m}-con{c}" for a, m, c in COMBOS])
def test_replicated_stream_stays_in_lockstep(dist_pool, tiny_bert_dir, att, mlp, con):
    (s0, logits0), (s1, logits1) = dist_pool(2).run(training_step_with_dropout, tiny_bert_dir, att, mlp, con)
    assert s0 == s1, "the default random stream diverged across ranks"
    # Everything after the encoder is replicated: the ranks must agree exactly.
    assert torch.equal(logits0, logits1)


def test_sharded_stream_differs_across_ranks(dist_pool):
    (sh0, rep0), (sh1, rep1) = dist_pool(2).run(sharded_stream_masks)
    assert torch.equal(rep0, rep1), "replicated masks must be identical"
    assert not torch.equal(sh0, sh1), "sharded masks must differ between ranks"
