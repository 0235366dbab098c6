"""The encoder-decoder families (BART) under per-sub-block plans train exactly like Hugging Face.

Tiny BartForConditionalGeneration (2 encoder and 2 decoder layers, 4 heads, MLP 96, LM head tied
to the shared table, non-zero biases, norms and final_logits_bias) on right-padded source rows of
12 tokens and target rows of 9 (labels -100 on padding, decoder inputs the labels shifted right).
At world 2 the 8 ATT x MLP x CON combinations, each with the XATT method that makes every pair of
the four methods appear (a 2^(4-1) design), uneven heads (3 / 1), MLP columns (64 / 32), source
tokens (7 / 5) and target tokens (4 / 5, the other rank larger); world 3 and serial. Each: logits,
loss, every gathered gradient, 5 SGD steps' losses and the final gathered weights within 1e-5
relative (fp32).
"""
import itertools

import pytest

from support.parity import check_report
from support.parity_runners import train_plan_and_compare
from support.tiny_models import TINY_SEQ, TINY_TARGET, tiny_seq2seq_batch

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


def check(reports):
    for rank, report in enumerate(reports):
        check_report(report, rank)


@pytest.mark.parametrize("att,mlp,con,xatt", COMBOS, ids=[plan_id("bart", *c) for c in COMBOS])
def test_bart_plan_matches_hf_world2_uneven(dist_pool, tiny_lm_dir, att, mlp, con, xatt):
    check(dist_pool(2).run(train_plan_and_compare, "bart", tiny_lm_dir("bart"), Plan(att, mlp, con, xatt=xatt),
                           SHARES[2], tiny_seq2seq_batch))


@pytest.mark.parametrize("att,mlp,con,xatt", WORLD3, ids=[plan_id("bart", *c) for c in WORLD3])
def test_bart_plan_matches_hf_world3(dist_pool, tiny_lm_dir, att, mlp, con, xatt):
    check(dist_pool(3).run(train_plan_and_compare, "bart", tiny_lm_dir("bart"), Plan(att, mlp, con, xatt=xatt),
                           SHARES[3], tiny_seq2seq_batch))


def test_bart_serial_matches_hf(dist_pool, tiny_lm_dir):
    check(dist_pool(1).run(train_plan_and_compare, "bart", tiny_lm_dir("bart"), Plan(), SHARES[1],
                           tiny_seq2seq_batch))
