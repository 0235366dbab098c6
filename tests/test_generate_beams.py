"""Beam search (galaxy.inference.beam_search) gives Hugging Face generate(num_beams=K,
do_sample=False)'s best beams, token for token: a causal LM (Llama) serially, at world 2 under ATT
TP and ATT SP with uneven shares (the SP caches' round-robin slots reorder with the beams), as a
2-stage pipeline (also of two Galaxy groups) and over 2 data-parallel replicas; encoder-decoders
(BART, T5) serially, under Galaxy plans at world 2 (XATT TP with uneven heads, XATT SP) and as
2-stage pipelines. A batch of unequal prompts, K = 2 and 3, with the model's EOS and with EOS
tokens that end beams early, length_penalty and each early_stopping rule. The beams' answers differ
from greedy's, so the search is exercised."""
import pytest

from support.generation_runners import galaxy_generate_cases, hf_generate, requests_for
from support.sharp_seq2seq import hf_seq2seq_generate, write_sharp_seq2seq

from galaxy.inference.sampling import Beams
from galaxy.plan import Plan

PAD, NEW = 24, 10
PROMPTS = ("The for statement is used to", "Lists", "A class definition defines a class object and then the")
# (num_beams, length_penalty, early_stopping, eos): None keeps the model's EOS; the others are
# tokens the beams of some prompts choose within a few steps, so hypotheses finish early.
CASES = [(2, 1.0, False, None), (3, 1.0, False, None), (2, 1.0, False, (310,)), (3, 1.0, False, (50, 505)),
         (3, 2.0, True, (89,)), (2, 0.5, "never", (310,)), (3, 1.0, True, (143, 310))]


def llama_plan(world, att="TP", mlp="TP", con="SP", **mesh):
    group = world // (mesh.get("pp", 1) * mesh.get("dp", 1))
    shares = {1: ((4,), (344,), (PAD,)), 2: ((2, 2), (200, 144), (14, 10))}[group]
    heads, columns, tokens = shares
    return Plan(att, mlp, con, heads=heads, columns=columns, tokens=tokens, stages=mesh.pop("stages", (4,)), **mesh)


@pytest.fixture(scope="module")
def llama(sharp_lm):
    """(model folder, requests and eos per case, HF's best beams per case, HF's greedy tokens)."""
    model_dir = sharp_lm("llama")
    cases, want = [], []
    for k, penalty, early, eos in CASES:
        cases.append((requests_for(model_dir, PROMPTS, NEW, beams=Beams(k, penalty, early)), eos))
        want.append(hf_generate("llama", model_dir, PROMPTS, NEW, eos=eos, num_beams=k, length_penalty=penalty,
                                early_stopping=early))
    greedy = hf_generate("llama", model_dir, PROMPTS, NEW)
    assert want[0] != greedy and want[1] != want[0], "the beams should find other answers than greedy's"
    assert any(len(row) < NEW for case in want[2:] for row in case), "some hypotheses should end at an EOS"
    return model_dir, cases, want


def check(pool, made, plans):
    model_dir, cases, want = made
    for rank, per_plan in enumerate(pool.run(galaxy_generate_cases, model_dir, plans, cases)):
        for plan, per_case in zip(plans, per_plan):
            for (requests, eos), expected, got in zip(cases, want, per_case):
                k, penalty, early = (getattr(requests[0].beams, f) for f in ("num_beams", "length_penalty",
                                                                             "early_stopping"))
                where = f"att {plan.att} mlp {plan.mlp} con {plan.con} pp {plan.pp} dp {plan.dp} rank {rank}: " \
                        f"K {k} length_penalty {penalty} early_stopping {early} eos {eos}"
                assert [tokens for tokens, _ in got] == expected, f"{where}: {got} != HF {expected}"
                reasons = ["stop" if len(row) < NEW or (eos and row[-1] in eos) else "length" for row in expected]
                assert [reason for _, reason in got] == reasons, where


def test_llama_serial_equals_hf_beams(dist_pool, llama):
    check(dist_pool(1), llama, [llama_plan(1)])


def test_llama_world2_tp_sp_pp_dp_equal_hf_beams(dist_pool, llama):
    """TP: each rank's K/V heads reorder; SP (uneven tokens 14 / 10): each rank's prompt tokens and
    every other decoded token reorder; pp 2: both stages' caches follow the broadcast beams."""
    check(dist_pool(2), llama, [llama_plan(2, "TP", "TP", "SP"), llama_plan(2, "SP", "TP", "SP"),
                                llama_plan(2, "SP", "SP", "None"), llama_plan(2, pp=2, stages=(3, 1)),
                                llama_plan(2, dp=2)])


# Encoder-decoders: EOS tokens that some prompts' beams choose early (T5's own EOS already does).
SEQ2SEQ_CASES = {
    "bart": [(2, 1.0, False, None), (3, 1.0, False, None), (2, 1.0, False, (166,)), (3, 2.0, True, (133, 498))],
    "t5": [(2, 1.0, False, None), (3, 1.0, False, None), (2, 1.0, "never", (370,)), (3, 0.5, True, (178, 49))],
}


@pytest.fixture(scope="module")
def seq2seq(tmp_path_factory):
    """seq2seq(family) -> (model folder, requests and eos per case, HF's best beams per case)."""
    made = {}

    def get(family):
        if family not in made:
            model_dir = write_sharp_seq2seq(family, str(tmp_path_factory.mktemp(f"beams_{family}")))
            cases, want = [], []
            for k, penalty, early, eos in SEQ2SEQ_CASES[family]:
                cases.append((requests_for(model_dir, PROMPTS, NEW, beams=Beams(k, penalty, early)), eos))
                want.append(hf_seq2seq_generate(model_dir, PROMPTS, NEW, eos=eos, num_beams=k, length_penalty=penalty,
                                                early_stopping=early))
            assert want[0] != hf_seq2seq_generate(model_dir, PROMPTS, NEW), "beams should differ from greedy"
            assert any(len(row) < NEW for case in want for row in case), "some hypotheses should end at an EOS"
            made[family] = model_dir, cases, want
        return made[family]
    return get


def seq2seq_plan(world, att="TP", mlp="TP", con="SP", xatt="TP", **mesh):
    heads, columns, tokens, decoder = {1: ((4,), (128,), (PAD,), (NEW,)),
                                       2: ((3, 1), (80, 48), (14, 10), (4, 6))}[world // mesh.get("pp", 1)]
    return Plan(att, mlp, con, xatt=xatt, heads=heads, columns=columns, tokens=tokens, decoder_tokens=decoder, **mesh)


@pytest.mark.parametrize("family", ("bart", "t5"))
def test_seq2seq_serial_plans_and_pp2_equal_hf_beams(dist_pool, seq2seq, family):
    """Every cache reorders: decoder ATT (TP heads; SP round-robin slots), XATT (the memory's K/V,
    TP heads or under SP the rank's source tokens), and the encoder's padding mask."""
    check(dist_pool(1), seq2seq(family), [seq2seq_plan(1)])
    check(dist_pool(2), seq2seq(family), [seq2seq_plan(2, "SP", "TP", "SP", "TP"),
                                          seq2seq_plan(2, "TP", "SP", "None", "SP"),
                                          seq2seq_plan(2, pp=2, stages=(3, 1) if family == "bart" else (1, 3))])


def test_llama_pp2_x_galaxy2_equals_hf_beams(dist_pool, llama):
    """Stages that are Galaxy groups under ATT SP: the parents cross the pipeline and both groups'
    round-robin caches reorder alike."""
    check(dist_pool(4), llama, [llama_plan(4, "SP", "TP", "SP", pp=2, stages=(2, 2))])
