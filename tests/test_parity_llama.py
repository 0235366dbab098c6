"""The decoder families (Llama, GPT-2) under every per-sub-block plan train exactly like HF.

Tiny Llama with grouped-query attention (8 query heads sharing 4 K/V heads: 2 per group) against
LlamaForCausalLM; tiny GPT-2 (4 heads, fused Q/K/V c_attn stored as Conv1D [in, out], biases and
LayerNorms away from their initial values, LM head tied to wte) against GPT2LMHeadModel. Right
padding and labels that ignore it. All 8 ATT x MLP x CON combinations at world 2 with uneven
shares (Llama: whole K/V groups per TP rank; GPT-2: heads 3 / 1, so a rank's c_attn share is three
column ranges of HF's tensor; SP attention causal across shards), world 3, tied embeddings, and
serial (and GPT-2 with scale_attn_by_inverse_layer_idx under the Galaxy plan): logits, loss,
every gathered gradient, 5 SGD steps' losses and the final gathered weights within 1e-5 relative
(fp32).
"""
import itertools

import pytest

from parity import check_report, train_and_compare
from tiny_models import GPT2_INTERMEDIATE, TINY_SEQ, make_tiny_gpt2, make_tiny_llama, tiny_lm_batch

from galaxy.parallel.plan import ParallelPlan

COMBOS = list(itertools.product(("TP", "SP"), ("TP", "SP"), ("SP", "None")))
UNEVEN_2 = ((6, 2), (64, 32), (7, 5))          # query heads, MLP columns, tokens
UNEVEN_3 = ((4, 2, 2), (40, 32, 24), (5, 4, 3))
# family -> (writer, shares at world 2, at world 3, serial)
FAMILIES = {
    "llama": (make_tiny_llama, UNEVEN_2, UNEVEN_3, ((8,), (96,), (TINY_SEQ,))),
    "gpt2": (make_tiny_gpt2, ((3, 1), (120, 72), (7, 5)), ((2, 1, 1), (64, 64, 64), (5, 4, 3)),
             ((4,), (GPT2_INTERMEDIATE,), (TINY_SEQ,))),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def lm(request, tmp_path_factory):
    """(family, tiny model directory, shares at world 2, 3, 1)."""
    write, *shares = FAMILIES[request.param]
    return (request.param, write(str(tmp_path_factory.mktemp(f"tiny_{request.param}"))), *shares)


@pytest.mark.parametrize("att,mlp,con", COMBOS, ids=[f"att{a}-mlp{m}-con{c}" for a, m, c in COMBOS])
def test_plan_matches_hf_world2_uneven(dist_pool, lm, att, mlp, con):
    family, model_dir, shares, _, _ = lm
    reports = dist_pool(2).run(train_and_compare, family, model_dir, ParallelPlan(att, mlp, con), shares,
                               tiny_lm_batch)
    for rank, report in enumerate(reports):
        check_report(report, rank)


@pytest.mark.parametrize("att,mlp,con", [("TP", "TP", "SP"), ("SP", "SP", "SP"), ("TP", "SP", "None")],
                         ids=["galaxy", "sp", "attTP-mlpSP-conNone"])
def test_plan_matches_hf_world3(dist_pool, lm, att, mlp, con):
    family, model_dir, _, shares, _ = lm
    reports = dist_pool(3).run(train_and_compare, family, model_dir, ParallelPlan(att, mlp, con), shares,
                               tiny_lm_batch)
    for rank, report in enumerate(reports):
        check_report(report, rank)


@pytest.fixture(scope="module")
def tied_llama_dir(tmp_path_factory):
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama_tied")), tie_word_embeddings=True)


@pytest.mark.parametrize("con", ["SP", "None"])
def test_tied_embeddings_match_hf(dist_pool, tied_llama_dir, con):
    reports = dist_pool(2).run(train_and_compare, "llama", tied_llama_dir, ParallelPlan("TP", "TP", con),
                               UNEVEN_2, tiny_lm_batch)
    for rank, report in enumerate(reports):
        check_report(report, rank)


def test_serial_matches_hf(dist_pool, lm):
    family, model_dir, _, _, shares = lm
    check_report(dist_pool(1).run(train_and_compare, family, model_dir, ParallelPlan(), shares, tiny_lm_batch)[0], 0)


def test_gpt2_attention_scaled_by_inverse_layer_index_matches_hf(dist_pool, tmp_path):
    """scale_attn_by_inverse_layer_idx: layer i's scores also divided by i + 1, as HF does.
    initializer_range 0.2: scores large enough that the scaling moves the logits ~10%."""
    model_dir = make_tiny_gpt2(str(tmp_path), scale_attn_by_inverse_layer_idx=True, initializer_range=0.2)
    reports = dist_pool(2).run(train_and_compare, "gpt2", model_dir, ParallelPlan.preset("galaxy"),
                               FAMILIES["gpt2"][1], tiny_lm_batch)
    for rank, report in enumerate(reports):
        check_report(report, rank)

