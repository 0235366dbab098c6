"""Encoder-decoders (BART, T5) as pipelines, and as sharded replicas, train exactly like Hugging Face.

The tiny models of test_parity_encdec.py (2 encoder and 2 decoder layers; stage splits count the
encoder's layers, then the decoder's) on a global batch of 8 right-padded rows (source 12
tokens, target 9), 5 SGD steps against BartForConditionalGeneration / T5ForConditionalGeneration:
step-0 logits of the evaluation forward, each step's loss, every step-0 gradient gathered over
stages and shards, the gradient norm and the final weights within 1e-5 relative (fp32).

Stage boundaries inside the encoder ([1, 3]: the second stage holds an encoder layer and the
whole decoder, and both stages a copy of T5's encoder position bias), between the stacks
([2, 2]: only the encoder's output and the decoder's embeddings cross) and inside the decoder
([3, 1]: two stages gather the encoder's output, and its gradient is the sum of both stages'
cross-attentions), under both schedules with 2 and 4 micro-batches; pp 3 ([1, 2, 1] and
[2, 1, 1]: the middle stage holds both stacks, bias copies on two of three stages); pp 2 x
Galaxy 2 (uneven heads, columns, source and target tokens) and pp 2 x dp 2 at world 4. Sharded
replicas (FSDP2, dp_sharding full and no_reshard) at dp 2.

Through the trainer: a T5 pipeline's checkpoint resumes in sharded replicas with the uninterrupted
run's losses and final weights, and the pipeline trains under bf16.
"""
import json
import os

import pytest
import torch

from support.parity import check_labelled_reports
from support.parity_runners import train_runners_and_compare
from support.tiny_models import TINY_SEQ, TINY_TARGET, tiny_seq2seq_batch

from galaxy.distributed.group import GalaxyGroup
from galaxy.models.attached import written_names
from galaxy.pipeline.carry import CarrySlot, carry_slots
from galaxy.pipeline.stage import keep_stage
from galaxy.plan import Plan
from galaxy.runtime.assemble import build_model

SERIAL = ((4,), (96,), (TINY_SEQ,), (TINY_TARGET,))
UNEVEN_2 = ((3, 1), (64, 32), (7, 5), (4, 5))
GALAXY = Plan.preset("galaxy")


def run(pool, cases):
    """cases: (label, family, model_dir, plan, pp, dp, shares, options); all in one pool call."""
    args = [(family, model_dir, plan, pp, dp, shares, tiny_seq2seq_batch, options)
            for _, family, model_dir, plan, pp, dp, shares, options in cases]
    ranks = pool.run(train_runners_and_compare, args)
    check_labelled_reports(ranks, [label for label, *_ in cases])
    return ranks


def pp_case(family, model_dir, stages, schedule, microbatches, pp=2, dp=1, plan=GALAXY, shares=SERIAL, tag="",
            **more):
    label = f"{family}{tag}-pp{pp}-dp{dp}-{stages}-{schedule}-mb{microbatches}"
    return (label, family, model_dir, plan, pp, dp, shares,
            {"stage_layers": stages, "schedule": schedule, "num_microbatches": microbatches, **more})


@pytest.mark.parametrize("family", ("bart", "t5"))
def test_pp2_boundaries_inside_between_and_after_the_encoder_match_hf(dist_pool, tiny_lm_dir, family):
    model_dir = tiny_lm_dir(family)
    cases = [pp_case(family, model_dir, [1, 3], "gpipe", 2), pp_case(family, model_dir, [2, 2], "1f1b", 2),
             pp_case(family, model_dir, [3, 1], "1f1b", 4)]
    ranks = run(dist_pool(2), cases)
    assert [[r["stage"] for r in reports] for reports in ranks] == [[[0], [0, 1], [0, 1, 2]],
                                                                    [[1, 2, 3], [2, 3], [3]]]


def test_t5_v1_1_pp2_matches_hf(dist_pool, tiny_lm_dir):
    """Gated GELU, the LM head apart from the shared table (no weight tied across the ends)."""
    model_dir = tiny_lm_dir("t5", v1_1=True)
    run(dist_pool(2), [pp_case("t5", model_dir, [1, 3], "1f1b", 2, tag="-v1.1"),
                       pp_case("t5", model_dir, [3, 1], "gpipe", 4, tag="-v1.1")])


def test_pp3_stages_holding_both_stacks_match_hf(dist_pool, tiny_lm_dir):
    """T5 [1, 2, 1]: the encoder's bias is on stages 0 and 1, the decoder's on 1 and 2 (a group of
    two of the three stages each); BART [2, 1, 1]: the encoder's output crosses two decoder stages.
    T5 again with 1f1b warm-ups [4, 4, 1] (pipeline_warmup_list) instead of torch's [3, 2, 1]."""
    run(dist_pool(3), [pp_case("t5", tiny_lm_dir("t5"), [1, 2, 1], "1f1b", 4, pp=3),
                       pp_case("t5", tiny_lm_dir("t5"), [1, 2, 1], "1f1b", 4, pp=3, tag="-warmup441",
                               warmup=[4, 4, 1]),
                       pp_case("bart", tiny_lm_dir("bart"), [2, 1, 1], "gpipe", 2, pp=3)])


def test_pp2_x_galaxy2_and_pp2_x_dp2_match_hf(dist_pool, tiny_lm_dir):
    """Stages that are uneven Galaxy groups (each stack split by its own token shares; the encoder's
    output crosses in its CON layout, own tokens only), and stages replicated by DDP."""
    tp_sp = Plan("TP", "SP", "SP", xatt="TP")
    sp_none = Plan("SP", "TP", "None", xatt="SP")
    cases = [pp_case("t5", tiny_lm_dir("t5"), [1, 3], "1f1b", 2, plan=tp_sp, shares=UNEVEN_2, tag="-galaxy2"),
             pp_case("bart", tiny_lm_dir("bart"), [2, 2], "gpipe", 2, plan=sp_none, shares=UNEVEN_2, tag="-galaxy2"),
             pp_case("t5", tiny_lm_dir("t5"), [1, 3], "1f1b", 2, dp=2)]
    ranks = run(dist_pool(4), cases)
    # ranks 0, 1: stage 0 (a Galaxy group of 2, or two replicas); ranks 2, 3: stage 1
    assert [reports[0]["stage"] for reports in ranks] == [[0], [0], [1, 2, 3], [1, 2, 3]]


def test_sharded_dp2_matches_hf(dist_pool, tiny_lm_dir):
    """FSDP2 over two replicas, each storing half of every parameter (a dim-0 half, give or take a row)."""
    cases = [(f"{family}-dp2-{sharding}", family, tiny_lm_dir(family), GALAXY, 1, 2, SERIAL,
              {"dp_sharding": sharding, "activation_checkpointing": recompute})
             for family, sharding, recompute in (("bart", "full", "none"), ("t5", "no_reshard", "full"))]
    for reports in run(dist_pool(2), cases):
        for report in reports:
            assert 0.45 < report["stored"] < 0.55, report["stored"]


# --- stages and their carry, single process --------------------------------------------------------

def _stage(model_dir, layers, first, last):
    model = build_model(model_dir, Plan(), GalaxyGroup.serial(4, 96, TINY_SEQ))
    return keep_stage(model, layers, first, last)


def test_t5_stages_keep_the_bias_tables_of_their_stacks(tiny_lm_dir):
    model_dir = tiny_lm_dir("t5")
    encoder_bias = "encoder_bias.relative_attention_bias.weight"
    first = _stage(model_dir, range(0, 1), True, False)
    both = _stage(model_dir, range(1, 4), False, True)
    decoder = _stage(model_dir, range(2, 4), False, True)
    assert (hasattr(first, "encoder_bias"), hasattr(first, "decoder_bias")) == (True, False)
    assert hasattr(both, "encoder_bias") and hasattr(both, "decoder_bias")
    assert not hasattr(decoder, "encoder_bias")
    # the stage holding the encoder's first layer writes the table; the other's copy is not written
    assert both.attached.stage_copies == {encoder_bias} and first.attached.stage_copies == frozenset()
    assert encoder_bias in written_names(first) and encoder_bias not in written_names(both)
    assert both.attached.stage.model_layers == 4
    assert set(both.layer_context(torch.ones(1, 5), torch.ones(1, 3))) == {"source", "target", "cross"}
    assert set(decoder.layer_context(torch.ones(1, 5), torch.ones(1, 3))) == {"target", "cross"}


def test_encoder_decoder_carry_at_each_boundary(tiny_lm_dir):
    """Inside the encoder both stacks' carries travel whole; from the encoder's end on, only its output."""
    t5 = _stage(tiny_lm_dir("t5"), range(1, 3), False, False)
    source, target = CarrySlot(48, True, "source"), CarrySlot(48, True, "target")
    assert carry_slots(t5, 1) == (source, source, target, target)
    assert carry_slots(t5, 2) == carry_slots(t5, 3) == (None, source, target, target)
    bart = _stage(tiny_lm_dir("bart"), range(0, 2), True, False)
    assert carry_slots(bart, 0) == (source, target) == carry_slots(bart, 2)


# --- through the trainer: resume across plans, bf16 -----------------------------------------------

TRAINING = dict(pad_size=24, target_pad_size=8, batch_size=8, optimizer="adamw", learning_rate=3e-3,
                lr_schedule="linear", warmup_steps=2, shuffle=True, dropout=0.0, timeout_s=60, max_eval_samples=8)
PP2_IN_ENCODER = dict(pp_deg=2, stage_num_hidden_layers_list=[1, 3], num_microbatches=2)
SHARDED_DP2 = dict(dp_deg=2, dp_sharding="full")


def t5_config(root, name, **keys) -> str:
    cfg = dict(model_path=os.path.join(os.path.dirname(os.path.dirname(__file__)), "models", "tiny-t5"),
               metrics_file=os.path.join(root, name, "metrics.jsonl"), **TRAINING, **keys)
    path = os.path.join(root, f"{name}.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path


def test_pipeline_checkpoint_resumes_in_sharded_replicas_and_bf16_trains(dist_pool, tmp_path):
    """T5, 6 AdamW steps as a pipeline split inside the encoder (each stage holds a copy of the
    encoder's position bias: the checkpoint has it once), saved at step 3; resumed from there in
    sharded replicas (FSDP2, dp 2), the losses of steps 4..6 and the weights at step 6 equal the
    uninterrupted run's to rounding. Under bf16 the same pipeline trains (2 steps, finite losses
    within 2e-2 of fp32's: one bf16 rounding is 3.9e-3)."""
    from safetensors.torch import load_file
    from support.trainer_support import step_losses, train_on_rank

    from galaxy.train.checkpoint import step_dir_name
    root, pool = str(tmp_path), dist_pool(2)
    runs = {"full": dict(save_dir=os.path.join(root, "full", "ck"), **PP2_IN_ENCODER),
            "resumed": dict(save_dir=os.path.join(root, "resumed", "ck"),
                            resume=os.path.join(root, "full", "ck", step_dir_name(3)), **SHARDED_DP2),
            "bf16": dict(mixed_precision="bf16", **PP2_IN_ENCODER)}
    for name, keys in runs.items():
        steps = dict(max_steps=2) if name == "bf16" else dict(max_steps=6, save_interval=3)
        pool.run(train_on_rank, t5_config(root, name, **steps, **keys), "galaxy", None, None, "seq2seq")
    full, resumed, bf16 = (step_losses(os.path.join(root, name, "metrics.jsonl")) for name in runs)
    assert sorted(resumed) == [4, 5, 6]
    assert max(abs(full[k] - resumed[k]) / full[k] for k in (4, 5, 6)) <= 1e-5, (full, resumed)
    weights = [load_file(os.path.join(root, name, "ck", step_dir_name(6), "model", "model.safetensors"))
               for name in ("full", "resumed")]
    assert weights[0].keys() == weights[1].keys()
    assert "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight" in weights[0]
    worst = max(((weights[0][k] - weights[1][k]).abs().max() / weights[0][k].abs().max()).item() for k in weights[0])
    assert worst <= 1e-5, worst
    assert all(abs(bf16[k] - full[k]) / full[k] < 2e-2 for k in (1, 2)), (bf16, full)
