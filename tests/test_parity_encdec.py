"""The encoder-decoder families (BART, T5) under per-sub-block plans train exactly like Hugging Face.

Tiny BartForConditionalGeneration (2 encoder and 2 decoder layers, 4 heads, MLP 96, LM head tied
to the shared table, non-zero biases, norms and final_logits_bias) and T5ForConditionalGeneration
(the same depth, 4 heads of 8 in a width of 48, relative position buckets 8 up to distance 16;
v1.0: ReLU MLP, tied and scaled head; v1.1: gated GELU, its own head) on right-padded source rows
of 12 tokens and target rows of 9 (labels -100 on padding, decoder inputs the labels shifted
right). At world 2 the 8 ATT x MLP x CON combinations, each with the XATT method that makes every
pair of the four methods appear (a 2^(4-1) design), uneven heads (3 / 1), MLP columns (64 / 32),
source tokens (7 / 5) and target tokens (4 / 5, the other rank larger), T5's in 2 batch streams;
world 3 and serial; T5
v1.1 under two plans and serially. Each: logits, loss, every gathered gradient, 5 SGD steps'
losses and the final gathered weights within 1e-5 relative (fp32).
"""
import itertools

import pytest

from support.parity import check_labelled_reports, check_report
from support.parity_runners import train_plans_and_compare, train_runner_and_compare
from support.peft_runners import lora_plan_vs_peft, peft_plan_vs_serial, write_peft_adapter
from support.tiny_models import TINY_SEQ, TINY_TARGET, tiny_seq2seq_batch, tiny_seq2seq_unmasked

from galaxy.peft import PeftOptions
from galaxy.plan import Plan


def xatt_of(att, mlp, con):
    """XATT's method in the half fraction of the 2^4 plans that covers every pair of methods."""
    return "TP" if (att == mlp) == (con == "SP") else "SP"


COMBOS = [(a, m, c, xatt_of(a, m, c)) for a, m, c in itertools.product(("TP", "SP"), ("TP", "SP"), ("SP", "None"))]
SHARES = {   # heads, MLP columns, source tokens, target tokens
    2: ((3, 1), (64, 32), (7, 5), (4, 5)),
    3: ((2, 1, 1), (40, 32, 24), (5, 4, 3), (2, 4, 3)),
    1: ((4,), (96,), (TINY_SEQ,), (TINY_TARGET,)),
}
WORLD3 = [("TP", "TP", "SP", "TP"), ("SP", "SP", "SP", "SP"), ("TP", "SP", "None", "SP")]


def plan_id(family, att, mlp, con, xatt):
    return f"{family}-att{att}-mlp{mlp}-con{con}-xatt{xatt}"


def run(dist_pool, world, family, model_dir, cases, build=None, batch_fn=tiny_seq2seq_batch):
    """Every case in one call to the pool (a case is milliseconds of work beside a launch); a
    failure names the plan. build: train_plan_and_compare's more keywords."""
    plans = [Plan(*case) if len(case) < 4 else Plan(*case[:3], xatt=case[3]) for case in cases]
    ranks = dist_pool(world).run(train_plans_and_compare, family, model_dir, plans, SHARES[world], batch_fn, build)
    check_labelled_reports(ranks, [plan_id(family, *case) if case else family + "-serial" for case in cases])


@pytest.mark.parametrize("family", ("bart", "t5"))
def test_world2_uneven_plans_match_hf(dist_pool, tiny_lm_dir, family):
    # T5 in 3 batch streams (a row each, the middle one out of phase): XATT's transitions, each
    # stream's own memory and bias rows
    run(dist_pool, 2, family, tiny_lm_dir(family), COMBOS, {"batch_streams": 3} if family == "t5" else None)


@pytest.mark.parametrize("family", ("bart", "t5"))
def test_world3_plans_match_hf(dist_pool, tiny_lm_dir, family):
    run(dist_pool, 3, family, tiny_lm_dir(family), WORLD3)


def test_serial_matches_hf(dist_pool, tiny_lm_dir):
    for family, overrides in (("bart", {}), ("t5", {}), ("t5", {"v1_1": True})):
        run(dist_pool, 1, family, tiny_lm_dir(family, **overrides), [()])


def test_t5_v1_1_gated_untied_matches_hf(dist_pool, tiny_lm_dir):
    """Gated-GELU MLP (wi_0, wi_1, wo), the LM head apart from the shared table, no output scale."""
    run(dist_pool, 2, "t5", tiny_lm_dir("t5", v1_1=True), [("TP", "TP", "SP", "SP"), ("SP", "SP", "None", "TP")])


@pytest.mark.parametrize("family", ("bart", "t5"))
def test_dp2_matches_hf(dist_pool, tiny_lm_dir, family):
    """Two replicas under DDP, 4 rows each, against HF on the global batch of 8."""
    for rank, report in enumerate(dist_pool(2).run(train_runner_and_compare, family, tiny_lm_dir(family), Plan(),
                                                   1, 2, SHARES[1], tiny_seq2seq_batch)):
        check_report(report, rank)


@pytest.mark.parametrize("family", ("bart", "t5"))
def test_no_decoder_mask_matches_hf(dist_pool, tiny_lm_dir, family):
    """No decoder_attention_mask: a causal mask over the target's 9 tokens (the source has 12)."""
    run(dist_pool, 2, family, tiny_lm_dir(family), [("TP", "SP", "SP", "TP")], batch_fn=tiny_seq2seq_unmasked)


@pytest.mark.parametrize("family,case", [("t5", ("TP", "TP", "SP", "SP")), ("bart", ("SP", "SP", "None", "TP"))])
def test_recomputed_layers_match_hf(dist_pool, tiny_lm_dir, family, case):
    """activation_checkpointing "full": every encoder and decoder layer recomputed in backward."""
    run(dist_pool, 2, family, tiny_lm_dir(family), [case], {"activation_checkpointing": "full"})


@pytest.mark.parametrize("family,targets,case", [("bart", ["q_proj", "v_proj", "fc1"], ("TP", "TP", "SP", "SP")),
                                                 ("t5", ["q", "v", "wo"], ("SP", "TP", "None", "TP"))])
def test_lora_matches_peft(dist_pool, tiny_lm_dir, tmp_path, family, targets, case):
    """LoRA on self- and cross-attention (and an MLP projection) from one random peft adapter:
    losses, logits and the adapter tensors after 5 SGD steps equal peft's on the HF model."""
    model_dir = tiny_lm_dir(family)
    adapter = write_peft_adapter(family, model_dir, str(tmp_path / "lora"), targets)
    plan = Plan(*case[:3], xatt=case[3])
    for rank, report in enumerate(dist_pool(2).run(lora_plan_vs_peft, family, model_dir, adapter, plan, SHARES[2],
                                                   tiny_seq2seq_batch)):
        assert max(report["loss"]) < 1e-5 and report["logits"] < 1e-5, (rank, report["loss"], report["logits"])
        assert report["tensors"][0] < 1e-5, (rank, report["tensors"])
        assert report["frozen_grads"] == [], (rank, report["frozen_grads"])


@pytest.mark.parametrize("family,case", [("bart", ("TP", "SP", "SP", "TP")), ("t5", ("SP", "TP", "None", "SP"))])
def test_adapters_match_serial(dist_pool, tiny_lm_dir, family, case):
    """Bottleneck adapters after self-attention, cross-attention and the MLP (peft has no format
    for them): the plan's losses, logits and adapter weights after 5 SGD steps equal galaxy serial."""
    options = PeftOptions("adapter", adapter_reduction_dim=8, non_linearity="gelu")
    plan = Plan(*case[:3], xatt=case[3])
    for rank, report in enumerate(dist_pool(2).run(peft_plan_vs_serial, tiny_lm_dir(family), plan, SHARES[2], options,
                                                   tiny_seq2seq_batch)):
        assert max(report["loss"]) < 1e-5 and report["logits"] < 1e-5, (rank, report["loss"], report["logits"])
        assert report["tensors"][0] < 1e-5, (rank, report["tensors"])
