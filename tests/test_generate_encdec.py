"""Encoder-decoder generation (galaxy.inference.seq2seq_engine) gives Hugging Face generate's greedy
tokens (BartForConditionalGeneration / T5ForConditionalGeneration, do_sample=False with its cache,
one beam, no forced or n-gram rules) serially and under plans: at world 2 the 8 ATT x MLP x CON
combinations, each with the XATT method that makes every pair of the four methods appear
(uneven heads 3 / 1, MLP columns, source tokens 14 / 10), and at world 3; a batch of right-padded
prompts of different lengths whose rows stop at different steps, and a single prompt with a stop
string. Each rank caches its share (decoder ATT: its heads, or under SP every other decoded
token; XATT: the memory's K/V of its heads, or under SP of its source tokens, attended there and
merged across the ranks by log-sum-exp: every XATT SP plan below checks that merge). Seeded sampling under a plan
and over 2 replicas draws the serial run's tokens; LoRA on self- and cross-attention gives
peft's tokens, applied or folded into the weights."""
import pytest

from support.generation_runners import (galaxy_generate, galaxy_generate_cache_shapes, galaxy_generate_plans,
                                        requests_for, tokenizer_of)
from support.sharp_seq2seq import hf_seq2seq_generate, write_sharp_seq2seq

from galaxy.inference.requests import Request
from galaxy.inference.sampling import Sampling
from galaxy.plan import Plan

PAD, NEW = 24, 10
PROMPTS = ("The for statement is used to", "Lists", "A class definition defines a class object and then the")
SHARES = {   # world -> (query heads of 4, MLP columns of 128, source tokens of PAD, decoder tokens)
    1: ((4,), (128,), (PAD,), (NEW,)),
    2: ((3, 1), (80, 48), (14, 10), (4, 6)),
    3: ((2, 1, 1), (48, 48, 32), (9, 8, 7), (3, 3, 4)),
}
COMBOS = [(a, m, c, "TP" if (a == m) == (c == "SP") else "SP")
          for a in ("TP", "SP") for m in ("TP", "SP") for c in ("SP", "None")]
WORLD3 = [("TP", "TP", "SP", "SP"), ("SP", "SP", "SP", "TP"), ("SP", "TP", "None", "SP")]


@pytest.fixture(scope="module")
def seq2seq(tmp_path_factory):
    """seq2seq(family) -> (model folder, HF's tokens for PROMPTS as one batch), written once."""
    made = {}

    def get(family):
        if family not in made:
            path = write_sharp_seq2seq(family, str(tmp_path_factory.mktemp(f"sharp_{family}")))
            made[family] = path, hf_seq2seq_generate(path, PROMPTS, NEW)
        return made[family]
    return get


def plan_of(world, att="TP", mlp="TP", con="SP", xatt="TP", **mesh):
    heads, columns, tokens, decoder = SHARES[world // (mesh.get("dp", 1) * mesh.get("pp", 1))]
    return Plan(att, mlp, con, xatt=xatt, heads=heads, columns=columns, tokens=tokens, decoder_tokens=decoder, **mesh)


def check_plans(pool, family, seq2seq, plans):
    """Every plan in one pool call; a failure names the plan and the rank."""
    model_dir, want = seq2seq(family)
    assert len({len(row) for row in want}) > 1, "the rows should stop at different steps"
    results = pool.run(galaxy_generate_plans, model_dir, plans, requests_for(model_dir, PROMPTS, NEW))
    for rank, per_plan in enumerate(results):
        for plan, (got, _) in zip(plans, per_plan):
            where = f"{family} att {plan.att} mlp {plan.mlp} con {plan.con} xatt {plan.xatt} stages {plan.stages} " \
                    f"rank {rank}"
            assert [tokens for tokens, _ in got] == want, f"{where}: {got} != HF {want}"


@pytest.mark.parametrize("family", ("bart", "t5"))
def test_serial_and_world2_plans_equal_hf_greedy(dist_pool, seq2seq, family):
    check_plans(dist_pool(1), family, seq2seq, [plan_of(1)])
    check_plans(dist_pool(2), family, seq2seq, [plan_of(2, *combo) for combo in COMBOS])


@pytest.mark.parametrize("family", ("bart", "t5"))
def test_world3_plans_equal_hf_greedy(dist_pool, seq2seq, family):
    check_plans(dist_pool(3), family, seq2seq, [plan_of(3, *combo) for combo in WORLD3])


BOUNDARIES = ((1, 3), (2, 2), (3, 1))      # inside the encoder, between the stacks, inside the decoder


@pytest.mark.parametrize("family", ("bart", "t5", "t5_v1_1"))
def test_pp2_with_each_boundary_equals_hf_greedy(dist_pool, seq2seq, family):
    """Two stages: the encoder's stages run once, the decoder's stream travels each step."""
    check_plans(dist_pool(2), family, seq2seq, [plan_of(2, pp=2, stages=stages) for stages in BOUNDARIES])


def test_pp2_x_galaxy2_equals_hf_greedy(dist_pool, seq2seq):
    """Stages that are uneven Galaxy groups: the encoder's output crosses in the CON layout (own
    source tokens), the decode steps' stream in R."""
    check_plans(dist_pool(4), "t5", seq2seq, [plan_of(4, "SP", "TP", "SP", "TP", pp=2, stages=(1, 3))])
    check_plans(dist_pool(4), "bart", seq2seq, [plan_of(4, "TP", "SP", "None", "SP", pp=2, stages=(3, 1))])


@pytest.mark.parametrize("family", ("bart", "t5"))
def test_a_single_prompt_with_a_stop_string(dist_pool, seq2seq, family):
    """Alone, the longest prompt gives its batch row; a stop string ends it at the token that
    completes it, the text cut before it."""
    model_dir, want = seq2seq(family)
    row = want[2]
    tok = tokenizer_of(model_dir)
    text = tok.decode(row, skip_special_tokens=True)
    stop = text[len(tok.decode(row[:3], skip_special_tokens=True)):][:2]
    ends = next(k for k in range(1, len(row) + 1) if stop in tok.decode(row[:k], skip_special_tokens=True))
    assert ends < len(row)
    single = Request(PROMPTS[2], tuple(tok(PROMPTS[2])["input_ids"]), NEW)
    stopped = Request(PROMPTS[2], single.ids, NEW, stop=(stop,))
    for plan in (plan_of(2, "SP", "TP", "SP", "TP"), plan_of(2, "TP", "SP", "None", "SP")):
        for rank, (got, _) in enumerate(dist_pool(2).run(galaxy_generate, model_dir, plan, [single, stopped])):
            assert got[0] == (row, "length" if len(row) == NEW else "stop"), f"rank {rank}"
            assert got[1] == (row[:ends], "stop"), f"rank {rank}: stop {stop!r}"


def test_each_rank_caches_its_share(dist_pool, seq2seq):
    """Decoder ATT: [3 rows, its K/V heads, NEW slots, 16] (SP: 4 heads, NEW / 2 slots); XATT:
    [3, its heads, PAD source slots, 16], under SP [3, all 4 heads, its source tokens (14 / 10), 16],
    the source padded to PAD even where XATT alone splits tokens; K and V fp32, a keep byte per
    slot. The reported MiB per rank are those bytes, and the tokens still Hugging Face's."""
    model_dir, want = seq2seq("t5")
    requests = requests_for(model_dir, PROMPTS, NEW)

    def mib(att_heads, att_slots, xatt_heads, slots=PAD):    # 2 decoder layers
        return 2 * (2 * 3 * 16 * 4 * (att_heads * att_slots + xatt_heads * slots) + 3 * (att_slots + slots)) / 2 ** 20
    longest = max(len(r.ids) for r in requests)         # serial: the prompts padded to the longest
    serial = dist_pool(1).run(galaxy_generate, model_dir, plan_of(1), requests)[0][1]
    assert serial == pytest.approx([mib(4, NEW, 4, longest)])
    plans = [plan_of(2, "TP", "TP", "SP", "TP"), plan_of(2, "SP", "TP", "SP", "SP"), plan_of(2, "TP", "TP", "None", "SP")]
    # XATT SP alone pads the prompts to PAD (and refuses longer ones up front), XATT TP does not
    assert plans[2].splits_prompt() and not plan_of(2, "TP", "TP", "None", "TP").splits_prompt()
    # per plan: rank -> (K/V heads, slots) of the decoder ATT's cache and of XATT's
    caches = [((3, NEW), (3, PAD)), ((1, NEW), (1, PAD))], [((4, NEW // 2), (4, 14)), ((4, NEW // 2), (4, 10))], \
        [((3, NEW), (4, 14)), ((1, NEW), (4, 10))]
    for rank, per_plan in enumerate(dist_pool(2).run(galaxy_generate_cache_shapes, model_dir, plans, requests)):
        for plan, ((got, reported), shapes), expected in zip(plans, per_plan, caches):
            where = f"att {plan.att} con {plan.con} xatt {plan.xatt} rank {rank}"
            assert [tokens for tokens, _ in got] == want, where
            (att_heads, att_slots), (xatt_heads, source) = expected[rank]
            assert shapes == {"att": [(3, att_heads, att_slots, 16)] * 2, "xatt": [(3, xatt_heads, source, 16)] * 2}, \
                where
            assert reported == pytest.approx([mib(*e[0], e[1][0], e[1][1]) for e in expected]), where


def test_seeded_sampling_under_plans_equals_serial(dist_pool, seq2seq):
    model_dir, _ = seq2seq("bart")
    requests = [requests_for(model_dir, [p], NEW, Sampling(temperature=1.5, top_k=40, top_p=0.95, seed=7 + i))[0]
                for i, p in enumerate(PROMPTS)]
    serial = dist_pool(1).run(galaxy_generate, model_dir, plan_of(1), requests)[0][0]
    assert len({tuple(t) for t, _ in serial}) == 3
    for plan in (plan_of(2, "SP", "TP", "SP", "TP"), plan_of(2, dp=2), plan_of(2, pp=2, stages=(2, 2))):
        for rank, (got, _) in enumerate(dist_pool(2).run(galaxy_generate, model_dir, plan, requests)):
            assert got == serial, f"{plan.att}/{plan.mlp}/{plan.con} xatt {plan.xatt} dp {plan.dp} rank {rank}"


@pytest.mark.parametrize("family,targets", [("bart", ["q_proj", "v_proj", "fc1"]), ("t5", ["q", "v", "wi"])])
def test_lora_on_self_and_cross_attention_equals_peft(dist_pool, seq2seq, tmp_path, family, targets):
    from support.peft_runners import write_peft_adapter
    from galaxy.peft import PeftOptions
    model_dir, _ = seq2seq(family)
    adapter = write_peft_adapter(family, model_dir, str(tmp_path / "adapter"), targets)
    model_dir, base = seq2seq(family)
    want = hf_seq2seq_generate(model_dir, PROMPTS, NEW, adapter=adapter)
    assert want != base, "the adapter should change the greedy tokens"
    lora = (PeftOptions("lora", lora_path=adapter), 0)
    requests = requests_for(model_dir, PROMPTS, NEW)
    for fold in (False, True):
        for rank, (got, _) in enumerate(dist_pool(2).run(galaxy_generate, model_dir, plan_of(2, "SP", "TP", "SP", "TP"),
                                                          requests, 8, lora, fold)):
            assert [t for t, _ in got] == want, f"fold {fold} rank {rank}"
