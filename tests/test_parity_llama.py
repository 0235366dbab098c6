"""Llama under every per-sub-block plan trains exactly like HF LlamaForCausalLM.

Tiny Llama with grouped-query attention (8 query heads sharing 4 K/V heads: 2 per group), right
padding and labels that ignore it. All 8 ATT x MLP x CON combinations at world 2 with uneven
shares (whole K/V groups per TP rank; SP attention causal across shards with global rotary
positions), world 3, tied embeddings, and serial: logits, loss, every gathered gradient, 5 SGD
steps' losses and the final gathered weights within 1e-5 relative (fp32).
"""
import itertools

import pytest

from parity import check_report, train_and_compare
from tiny_models import TINY_SEQ, make_tiny_llama, tiny_lm_batch

from galaxy.parallel.plan import ParallelPlan

COMBOS = list(itertools.product(("TP", "SP"), ("TP", "SP"), ("SP", "None")))
UNEVEN_2 = ((6, 2), (64, 32), (7, 5))          # query heads, MLP columns, tokens
UNEVEN_3 = ((4, 2, 2), (40, 32, 24), (5, 4, 3))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama")))


@pytest.fixture(scope="module")
def tied_llama_dir(tmp_path_factory):
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama_tied")), tie_word_embeddings=True)


@pytest.mark.parametrize("att,mlp,con", COMBOS, ids=[f"att{a}-mlp{m}-con{c}" for a, m, c in COMBOS])
def test_plan_matches_hf_world2_uneven(dist_pool, llama_dir, att, mlp, con):
    reports = dist_pool(2).run(train_and_compare, "llama", llama_dir, ParallelPlan(att, mlp, con), UNEVEN_2,
                               tiny_lm_batch)
    for rank, report in enumerate(reports):
        check_report(report, rank)


@pytest.mark.parametrize("att,mlp,con", [("TP", "TP", "SP"), ("SP", "SP", "SP"), ("TP", "SP", "None")],
                         ids=["galaxy", "sp", "attTP-mlpSP-conNone"])
def test_plan_matches_hf_world3(dist_pool, llama_dir, att, mlp, con):
    reports = dist_pool(3).run(train_and_compare, "llama", llama_dir, ParallelPlan(att, mlp, con), UNEVEN_3,
                               tiny_lm_batch)
    for rank, report in enumerate(reports):
        check_report(report, rank)


@pytest.mark.parametrize("con", ["SP", "None"])
def test_tied_embeddings_match_hf(dist_pool, tied_llama_dir, con):
    reports = dist_pool(2).run(train_and_compare, "llama", tied_llama_dir, ParallelPlan("TP", "TP", con),
                               UNEVEN_2, tiny_lm_batch)
    for rank, report in enumerate(reports):
        check_report(report, rank)


def test_serial_matches_hf(dist_pool, llama_dir):
    report = dist_pool(1).run(train_and_compare, "llama", llama_dir, ParallelPlan(),
                              ((8,), (96,), (TINY_SEQ,)), tiny_lm_batch)[0]
    check_report(report, 0)
