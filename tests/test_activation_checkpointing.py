"""Activation checkpointing (config key activation_checkpointing) changes memory, not numbers.

Dropout off: HF parity holds with recomputed layers under Galaxy plans, DP and PP, for BERT and
Llama. Dropout on: the losses and gradients of a run with every layer recomputed equal those of
the same run without, under a plan whose CON and attention dropout draw from the sharded
per-rank stream (the masks of the recomputation are those of the first forward).
"""
from dataclasses import replace

import pytest
import torch

from support.parity import check_report, world_group
from support.parity_runners import train_plan_and_compare, train_runner_and_compare
from support.tiny_models import TINY_SEQ, make_tiny_bert, make_tiny_llama, tiny_batch, tiny_lm_batch

from galaxy.parallel.full_state import gather_full
from galaxy.parallel.grad_sync import GradientSync
from galaxy.plan import Plan, PlanError, recompute_layers
from galaxy.runtime.assemble import build_model

GALAXY = Plan("TP", "TP", "SP")
UNEVEN_2 = ((4, 2), (64, 32), (7, 5))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_llama(str(tmp_path_factory.mktemp("ckpt_llama")))


@pytest.fixture(scope="module")
def dropout_bert_dir(tmp_path_factory):
    return make_tiny_bert(str(tmp_path_factory.mktemp("ckpt_bert")), hidden_dropout_prob=0.2,
                          attention_probs_dropout_prob=0.2)


# Batch streams (2) with a recomputed layer beside an interleaved one, and with every layer recomputed
@pytest.mark.parametrize("family,plan,spec", [
    ("bert", replace(GALAXY, batch_streams=2), "full"), ("bert", Plan("SP", "SP", "SP"), [1]),
    ("llama", Plan("SP", "TP", "SP"), 1), ("llama", Plan("TP", "TP", "SP", batch_streams=2), 1),
    ("llama", Plan("TP", "SP", "None"), "full")],
    ids=["bert-galaxy-full-streams2", "bert-sp-layer1", "llama-attSP-first1", "llama-galaxy-first1-streams2",
         "llama-conNone-full"])
def test_recomputed_layers_match_hf(dist_pool, tiny_bert_dir, llama_dir, family, plan, spec):
    model_dir, batch_fn, shares = ((tiny_bert_dir, tiny_batch, ((4, 2), (64, 32), (7, 5))) if family == "bert"
                                   else (llama_dir, tiny_lm_batch, ((6, 2), (64, 32), (7, 5))))
    reports = dist_pool(2).run(train_plan_and_compare, family, model_dir, plan, shares, batch_fn, 5, None,
                               {"activation_checkpointing": spec})
    for rank, report in enumerate(reports):
        check_report(report, rank)


@pytest.mark.parametrize("family,pp,dp", [("bert", 2, 1), ("llama", 1, 2), ("llama", 2, 2)],
                         ids=["bert-pp2", "llama-dp2", "llama-pp2xdp2"])
def test_recomputed_layers_on_a_mesh_match_hf(dist_pool, tiny_bert_dir, llama_dir, family, pp, dp):
    model_dir, batch_fn = (tiny_bert_dir, tiny_batch) if family == "bert" else (llama_dir, tiny_lm_batch)
    heads = 6 if family == "bert" else 8
    shares = ((heads,), (96,), (TINY_SEQ,))
    reports = dist_pool(pp * dp).run(train_runner_and_compare, family, model_dir, GALAXY, pp, dp, shares,
                                     batch_fn, {"activation_checkpointing": "full", "num_microbatches": 2})
    for rank, report in enumerate(reports):
        check_report(report, rank)


def dropout_run(model_dir, spec, steps=3):
    """Losses and gathered gradients of `steps` SGD steps with dropout on, Galaxy plan, uneven."""
    torch.manual_seed(0)
    group = world_group(*UNEVEN_2)
    model = build_model(model_dir, replace(GALAXY, checkpoint=spec), group, num_labels=3, seed=5)
    sync, opt = GradientSync(model, group.pg), torch.optim.SGD(model.parameters(), lr=0.5)
    losses, grads = [], []
    for step in range(steps):
        loss = model(**tiny_batch(seed=step))[1]
        loss.backward()
        sync()
        losses.append(loss.item())
        grads.append(gather_full(model, grads=True))
        opt.step()
        opt.zero_grad()
    return losses, grads


def compare_dropout_runs(model_dir):
    plain, recomputed = dropout_run(model_dir, "none"), dropout_run(model_dir, "full")
    worst = max((a - b).abs().max().item() for g, h in zip(plain[1], recomputed[1]) for a, b in
                ((g[n], h[n]) for n in g))
    return plain[0], recomputed[0], worst


def test_recompute_replays_dropout_masks(dist_pool, dropout_bert_dir):
    for plain, recomputed, worst in dist_pool(2).run(compare_dropout_runs, dropout_bert_dir):
        assert plain == pytest.approx(recomputed, rel=1e-6, abs=0), (plain, recomputed)
        assert worst < 1e-6, f"gradients differ by {worst}"
        assert len(set(plain)) == len(plain)      # the losses move: training really ran


def test_recompute_layers_spec():
    assert recompute_layers("none", 4) == frozenset()
    assert recompute_layers("full", 3) == {0, 1, 2}
    assert recompute_layers(2, 4) == {0, 1}
    assert recompute_layers([3, 1], 4) == {1, 3}
    with pytest.raises(PlanError, match="names layer 4"):
        recompute_layers([4], 4)
    with pytest.raises(PlanError, match="activation_checkpointing 5"):
        recompute_layers(5, 4)
