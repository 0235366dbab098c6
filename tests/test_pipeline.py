"""Pipeline parallelism trains exactly like HF serial training, for BERT and Llama.

5 SGD steps on a global batch of 8 in 4 micro-batches; every rank compares the step-0 logits of
the evaluation forward, each step's loss (the global-batch mean, which every stage reports) and,
gathered over stages and Galaxy shards, the step-0 gradients and the final weights with the
serial Hugging Face model within 1e-5 relative (fp32, dropout 0): world 2 and 3 with uneven
stages under both schedules, pp 2 x Galaxy 2 (world 4), Llama (token-weighted loss over
micro-batches of very different token counts) at world 2 (and Qwen2, Llama with q/k/v biases),
and Llama at pp 2 x dp 2 (world 4); Llama with tied embeddings split across the ends (pp 2,
pp 2 x dp 2, pp 3), and GPT-2 (its LM head always tied to wte) at pp 2; pp 2 and pp 2 x Galaxy 2
placed out of launch order (mesh_rank_order). The stage split and pruning are checked alone.
"""
import pytest
import torch

from support.parity import check_report
from support.parity_runners import train_runner_and_compare
from support.tiny_models import GPT2_INTERMEDIATE, TINY_SEQ, make_tiny_bert, make_tiny_llama, tiny_batch, tiny_lm_batch

from galaxy.distributed.group import GalaxyGroup
from galaxy.runtime.assemble import build_model
from galaxy.plan import Plan, PlanError, Workload
from galaxy.pipeline.stage import keep_stage

SERIAL = ((6,), (96,), (TINY_SEQ,))          # tiny BERT: 6 heads, 96 columns, 12 tokens
UNEVEN_2 = ((4, 2), (64, 32), (7, 5))
GALAXY = Plan.preset("galaxy")


@pytest.fixture(scope="module")
def bert3_dir(tmp_path_factory):
    return make_tiny_bert(str(tmp_path_factory.mktemp("bert3")), num_hidden_layers=3)


@pytest.fixture(scope="module")
def bert4_dir(tmp_path_factory):
    return make_tiny_bert(str(tmp_path_factory.mktemp("bert4")), num_hidden_layers=4)


@pytest.fixture(scope="module")
def llama3_dir(tiny_lm_dir):
    return tiny_lm_dir("llama", num_hidden_layers=3)


def run_case(pool, family, model_dir, plan, pp, shares, batch_fn, dp=1, **options):
    reports = pool.run(train_runner_and_compare, family, model_dir, plan, pp, dp, shares, batch_fn,
                       {"num_microbatches": 4, **options})
    for rank, report in enumerate(reports):
        check_report(report, rank)
    return reports


@pytest.mark.parametrize("schedule,stages", [("gpipe", [2, 1]), ("1f1b", [1, 2])])
def test_world2_matches_hf(dist_pool, bert3_dir, schedule, stages):
    reports = run_case(dist_pool(2), "bert", bert3_dir, GALAXY, 2, SERIAL, tiny_batch,
                       schedule=schedule, stage_layers=stages)
    assert [r["stage"] for r in reports] == [list(range(stages[0])), list(range(stages[0], 3))]


@pytest.mark.parametrize("schedule,stages,warmup", [("gpipe", [2, 1, 1], None), ("1f1b", [1, 1, 2], None),
                                                    ("1f1b", [2, 1, 1], [4, 2, 2])])
def test_world3_matches_hf(dist_pool, bert4_dir, schedule, stages, warmup):
    """warmup: 1f1b's forwards per stage before its first backward (None: torch's 3, 2, 1)."""
    run_case(dist_pool(3), "bert", bert4_dir, GALAXY, 3, SERIAL, tiny_batch, schedule=schedule,
             stage_layers=stages, warmup=warmup)


def test_pp2_x_galaxy2_matches_hf(dist_pool, bert3_dir):
    """Stages are Galaxy groups (uneven heads, columns, tokens): rank r of stage 0 talks to rank r of stage 1.
    Each micro-batch's 2 rows run as 2 batch streams inside each stage."""
    reports = run_case(dist_pool(4), "bert", bert3_dir, GALAXY, 2, UNEVEN_2, tiny_batch, stage_layers=[2, 1],
                       batch_streams=2)
    assert [r["stage"] for r in reports] == [[0, 1], [0, 1], [2], [2]]


def test_pp2_placed_in_reverse_matches_hf(dist_pool, bert3_dir):
    """mesh_rank_order [1, 0] (a pool joined through galaxy.launch.init_distributed, reporting by
    launch rank): launch rank 1 holds stage 0 (layers 0-1), launch rank 0 stage 1 (layer 2)."""
    reports = run_case(dist_pool(2, (1, 0)), "bert", bert3_dir, GALAXY, 2, SERIAL, tiny_batch, stage_layers=[2, 1])
    assert [r["stage"] for r in reports] == [[2], [0, 1]]


def test_pp2_x_galaxy2_placed_matches_hf(dist_pool, bert3_dir):
    """mesh_rank_order [2, 0, 3, 1]: stage 0's Galaxy ranks 0, 1 are launch ranks 2, 0; stage 1's
    launch ranks 3, 1 (uneven shares, gpipe)."""
    reports = run_case(dist_pool(4, (2, 0, 3, 1)), "bert", bert3_dir, GALAXY, 2, UNEVEN_2, tiny_batch,
                       stage_layers=[1, 2], schedule="gpipe")
    assert [r["stage"] for r in reports] == [[0], [1, 2], [0], [1, 2]]


@pytest.mark.parametrize("family,schedule", [("llama", "gpipe"), ("llama", "1f1b"), ("qwen2", "1f1b")])
def test_llama_world2_matches_hf(dist_pool, tiny_lm_dir, family, schedule):
    """Micro-batches hold 20, 6, 4 and 4 label tokens: the loss is weighted by tokens, not averaged."""
    run_case(dist_pool(2), family, tiny_lm_dir(family, num_hidden_layers=3), GALAXY, 2, ((8,), (96,), (TINY_SEQ,)),
             tiny_lm_batch, schedule=schedule, stage_layers=[2, 1])


# family -> (tiny 3-layer model with its LM head tied to the embeddings, serial shares)
TIED = {"llama": (dict(num_hidden_layers=3, tie_word_embeddings=True), ((8,), (96,), (TINY_SEQ,))),
        "gpt2": (dict(n_layer=3), ((4,), (GPT2_INTERMEDIATE,), (TINY_SEQ,)))}


@pytest.mark.parametrize("family,pp,dp,stages", [("llama", 2, 1, [2, 1]), ("llama", 2, 2, [2, 1]),
                                                 ("llama", 3, 1, [1, 1, 1]), ("gpt2", 2, 1, [1, 2])],
                         ids=["llama-pp2", "llama-pp2-dp2", "llama-pp3", "gpt2-pp2"])
def test_tied_embeddings_across_stages_match_hf(dist_pool, tiny_lm_dir, family, pp, dp, stages):
    """The embedding (stage 0) and LM head (last stage) copies of the tied weight get the sum of
    both gradients, so they step as HF's one weight does (at the causal LMs' stable lr,
    parity_runners.STABLE_LR: at 0.5 even galaxy's single-process model ends 5e-5 from HF)."""
    overrides, serial = TIED[family]
    run_case(dist_pool(pp * dp), family, tiny_lm_dir(family, **overrides), GALAXY, pp, serial, tiny_lm_batch, dp=dp,
             stage_layers=stages)


def test_pp2_x_dp2_llama_matches_hf(dist_pool, llama3_dir):
    """Stages wrapped in DDP: replicas average once, after the last micro-batch's backward."""
    run_case(dist_pool(4), "llama", llama3_dir, GALAXY, 2, ((8,), (96,), (TINY_SEQ,)), tiny_lm_batch, dp=2,
             num_microbatches=2, stage_layers=[1, 2])


# --- the stage split, single process ---------------------------------------------------------------

def stage_layers(layers: int, pp: int, stages=None):
    """The stages' layer ranges of a resolved pp-stage plan on a model of `layers` layers."""
    work = Workload(heads=1, kv_heads=1, columns=1, layers=layers, tokens=pp, rows=pp)
    return Plan(pp=pp, microbatches=pp, stages=stages).resolve(pp, work).stage_layers()


def test_stage_layer_ranges():
    assert stage_layers(6, 2) == [range(0, 3), range(3, 6)]
    assert stage_layers(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert stage_layers(6, 3, (1, 4, 1)) == [range(0, 1), range(1, 5), range(5, 6)]
    with pytest.raises(PlanError, match="sums to 5"):
        stage_layers(6, 2, (2, 3))
    with pytest.raises(PlanError, match="has 2 entries but pp_deg is 3"):
        stage_layers(6, 3, (3, 3))
    with pytest.raises(PlanError, match="entries must be at least 1"):
        stage_layers(6, 2, (6, 0))
    with pytest.raises(PlanError, match="pp_deg 3 exceeds the model's 2 layers"):
        stage_layers(2, 3)


def _serial_model(model_dir):
    return build_model(model_dir, Plan(), GalaxyGroup.serial(6, 96, TINY_SEQ), num_labels=3)


def test_keep_stage_keeps_full_model_names(bert4_dir):
    full = dict(_serial_model(bert4_dir).named_parameters())
    middle = keep_stage(_serial_model(bert4_dir), range(1, 3), first=False, last=False)
    names = [n for n, _ in middle.named_parameters()]
    assert names and all(n.startswith(("layers.1.", "layers.2.")) for n in names)
    assert set(middle.attached.rules) == set(names)
    for name, p in middle.named_parameters():
        assert torch.equal(p, full[name]), name
    assert [i for i in middle.layers.indices] == [1, 2]
    last = keep_stage(_serial_model(bert4_dir), range(3, 4), first=False, last=True)
    assert {n.split(".")[0] for n, _ in last.named_parameters()} == {"layers", "pooler", "classifier"}


def test_tied_embeddings_split_into_two_equal_copies(tmp_path):
    model_dir = make_tiny_llama(str(tmp_path), tie_word_embeddings=True)
    serial = lambda: build_model(model_dir, Plan(), GalaxyGroup.serial(8, 96, TINY_SEQ))
    first = keep_stage(serial(), range(0, 1), first=True, last=False)
    last = keep_stage(serial(), range(1, 2), first=False, last=True)
    assert first.attached.tied_across_stages == last.attached.tied_across_stages == {"lm_head.weight": "embed_tokens.weight"}
    copy, original = dict(last.named_parameters())["lm_head.weight"], dict(first.named_parameters())["embed_tokens.weight"]
    assert copy is not original and torch.equal(copy, original)
    assert last.attached.rules["lm_head.weight"] == first.attached.rules["embed_tokens.weight"]
    assert keep_stage(serial(), range(0, 2), first=True, last=True).attached.tied_across_stages == {}
