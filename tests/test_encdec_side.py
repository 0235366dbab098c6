"""Ladder side-tuning of the encoder-decoders (BART, T5 v1.0 and v1.1): the same training under
every layout, for both tasks (seq2seq and classification).

The tiny models of test_parity_encdec.py and test_encdec_classify.py with a side network of
width 12 (4 heads): a side encoder beside the encoder, a side decoder beside the decoder whose
blocks cross-attend to the side encoder's output (galaxy.peft.side_seq2seq). Under Galaxy plans
at world 2 with uneven shares (heads 3 / 1, MLP columns 64 / 32, source tokens 7 / 5, target
tokens 4 / 5 or, a classifier's shifted source, 5 / 7): both CON layouts, ATT and MLP TP and SP,
XATT TP and SP; at dp 2; as pipelines at pp 2 with a boundary inside the encoder ([1, 3]) and
one between the stacks ([2, 2]), and pp 2 x Galaxy 2 (the side states cross sequence-sharded):
the loss of each of 5 SGD steps and every trained tensor at the end (gathered to full shape)
match galaxy's serial run with the same seed within 1e-5 relative. At step 0 a use_side model
computes the base model's logits bit for bit; side-only never runs a backbone layer, use_side
runs them without autograd; frozen weights get no gradient.
"""
import pytest
import torch

from support.peft_runners import base_outputs_kept, peft_cases_vs_serial, record_layer_outputs, serial_group
from support.tiny_models import (TINY_SEQ, TINY_TARGET, tiny_encdec_cls_batch,
                                 tiny_seq2seq_batch, tiny_t5_cls_batch)

from galaxy.peft import PeftOptions, apply_peft, export_peft
from galaxy.plan import Plan
from galaxy.runtime.assemble import build_model

TOL = 1e-5
OPTIONS = {"side": PeftOptions("side", side_reduction_factor=4),
           "side_only": PeftOptions("side_only", side_reduction_factor=4)}
# (ATT, MLP, CON, XATT): both CON layouts, each sub-block TP and SP
PLANS = [("TP", "TP", "SP", "SP"), ("SP", "SP", "None", "TP"), ("TP", "SP", "SP", "TP"), ("SP", "TP", "None", "SP")]
SEQ2SEQ_SHARES = {2: ((3, 1), (64, 32), (7, 5), (4, 5)), 1: ((4,), (96,), (TINY_SEQ,), (TINY_TARGET,))}
CLS_SHARES = {2: ((3, 1), (64, 32), (7, 5), (5, 7)), 1: ((4,), (96,), (TINY_SEQ,), (TINY_SEQ,))}
CLS_BATCHES = {"bart": tiny_encdec_cls_batch, "t5": tiny_t5_cls_batch}
# SGD's rate: parity_runners.STABLE_LR's reasoning; at 0.5 T5's scalar ladder gates end 1.1e-5 apart
# (sums in another order, amplified over 5 steps), at 0.1 they stay at rounding.
LR = 0.1
MODELS = {"bart": ("bart", {}), "t5": ("t5", {}), "t5-v1.1": ("t5", {"v1_1": True})}


def plan_of(case) -> Plan:
    return Plan(*case[:3], xatt=case[3])


def check(ranks, labels):
    """Every case's 5-step losses and trained tensors within TOL on every rank."""
    for rank, reports in enumerate(ranks):
        for label, report in zip(labels, reports, strict=True):
            assert max(report["loss"]) < TOL, f"{label} rank {rank}: losses off by {report['loss']}"
            assert report["tensors"][0] < TOL, f"{label} rank {rank}: {report['tensors'][1]} off by {report['tensors'][0]}"
            print(f"{label} rank {rank}: loss {max(report['loss']):.1e}, tensors {report['tensors'][0]:.1e}")


def plan_cases(model_dir, shares, batch_fn, task=None):
    """Each side method under two of PLANS, the methods' plans together covering all four."""
    cases, labels = [], []
    for i, method in enumerate(OPTIONS):
        for case in PLANS[2 * i:2 * i + 2]:
            cases.append(dict(model_dir=model_dir, plan=plan_of(case), pp=1, dp=1, shares=shares,
                              options=OPTIONS[method], batch_fn=batch_fn, global_batch=None, num_microbatches=1,
                              task=task, lr=LR))
            labels.append(f"{method} {case}")
    return cases, labels


@pytest.mark.parametrize("model", list(MODELS))
def test_seq2seq_plans_match_serial(dist_pool, tiny_lm_dir, model):
    family, overrides = MODELS[model]
    cases, labels = plan_cases(tiny_lm_dir(family, **overrides), SEQ2SEQ_SHARES[2], tiny_seq2seq_batch)
    check(dist_pool(2).run(peft_cases_vs_serial, cases), labels)


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_classifier_plans_match_serial(dist_pool, encdec_classifier_dir, family):
    cases, labels = plan_cases(encdec_classifier_dir(family), CLS_SHARES[2], CLS_BATCHES[family], "classification")
    check(dist_pool(2).run(peft_cases_vs_serial, cases), labels)


def mesh_case(model_dir, method, pp, dp, batch_fn, shares, task=None, stages=None, plan=Plan(), sharding="none"):
    return dict(model_dir=model_dir, plan=plan, pp=pp, dp=dp, shares=shares, options=OPTIONS[method],
                batch_fn=batch_fn, task=task, stage_layers=stages, lr=LR, dp_sharding=sharding)


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_dp2_and_pipelines_match_serial(dist_pool, tiny_lm_dir, encdec_classifier_dir, family):
    """dp 2 (seq2seq and classification; FSDP2 no_reshard: the frozen backbone's layers gather and
    never reduce); pp 2 split inside the encoder and between the stacks (seq2seq, and a classifier,
    whose last stage pools from positions the runner hands it)."""
    lm, serial = tiny_lm_dir(family), SEQ2SEQ_SHARES[1]
    cases = [mesh_case(lm, "side", 1, 2, tiny_seq2seq_batch, serial),
             mesh_case(encdec_classifier_dir(family), "side_only", 1, 2, CLS_BATCHES[family], CLS_SHARES[1],
                       "classification"),
             mesh_case(lm, "side", 2, 1, tiny_seq2seq_batch, serial, stages=[1, 3]),
             mesh_case(lm, "side_only", 2, 1, tiny_seq2seq_batch, serial, stages=[1, 3]),
             mesh_case(lm, "side", 2, 1, tiny_seq2seq_batch, serial, stages=[2, 2]),
             mesh_case(lm, "side", 1, 2, tiny_seq2seq_batch, serial, sharding="no_reshard"),
             mesh_case(encdec_classifier_dir(family), "side", 2, 1, CLS_BATCHES[family], CLS_SHARES[1], "classification",
                       stages=[2, 2])]
    labels = ["side dp2", "side_only classifier dp2", "side pp2 [1, 3]", "side_only pp2 [1, 3]", "side pp2 [2, 2]",
              "side dp2 sharded", "side classifier pp2 [2, 2]"]
    check(dist_pool(2).run(peft_cases_vs_serial, cases), labels)


def test_pipeline_of_galaxy_groups_matches_serial(dist_pool, tiny_lm_dir):
    """pp 2 x Galaxy 2 (CON SP, uneven source and target tokens): both side states travel
    sequence-sharded, each by its own stack's shares, across a boundary inside the encoder."""
    lm, shares = tiny_lm_dir("t5"), SEQ2SEQ_SHARES[2]
    cases = [mesh_case(lm, method, 2, 1, tiny_seq2seq_batch, shares, stages=[1, 3], plan=plan_of(PLANS[0]))
             for method in OPTIONS]
    check(dist_pool(4).run(peft_cases_vs_serial, cases), list(OPTIONS))


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_step_zero_is_the_base_model(dist_pool, tiny_lm_dir, encdec_classifier_dir, family):
    """up = 0 at the start: the base model's logits, bit for bit (forwards without autograd)."""
    side = OPTIONS["side"]
    assert dist_pool(1).run(base_outputs_kept, tiny_lm_dir(family), Plan(), SEQ2SEQ_SHARES[1], side,
                            tiny_seq2seq_batch, None, False)[0]
    for model_dir, shares, batch_fn, task in ((tiny_lm_dir(family), SEQ2SEQ_SHARES[2], tiny_seq2seq_batch, None),
                                              (encdec_classifier_dir(family), CLS_SHARES[2], CLS_BATCHES[family],
                                               "classification")):
        assert all(dist_pool(2).run(base_outputs_kept, model_dir, plan_of(PLANS[0]), shares, side, batch_fn,
                                    task, False))


def serial(model_dir, method, task=None):
    model = build_model(model_dir, Plan(), serial_group(SEQ2SEQ_SHARES[1]), num_labels=3, task=task)
    return model, apply_peft(model, OPTIONS[method], seed=0)


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_side_only_never_runs_the_backbone_layers(tiny_lm_dir, family):
    model, trainable = serial(tiny_lm_dir(family), "side_only")
    seen = record_layer_outputs(model)
    model(**tiny_seq2seq_batch(0))[1].backward()
    assert seen == []
    assert {n for n, p in model.named_parameters() if p.grad is not None} == set(trainable)
    # the side decoder's blocks cross-attend to the side encoder's output, whose blocks train through it
    assert model.layers[2].side.block.cross.kv.weight.grad.abs().sum() > 0
    assert model.layers[0].side.block.attn.qkv.weight.grad.abs().sum() > 0
    assert "are not run" in model.attached.peft.description


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_side_runs_the_backbone_without_autograd(tiny_lm_dir, encdec_classifier_dir, family):
    for model_dir, task, batch in ((tiny_lm_dir(family), None, tiny_seq2seq_batch(0)),
                                   (encdec_classifier_dir(family), "classification", CLS_BATCHES[family](0))):
        model, trainable = serial(model_dir, "side", task)
        seen = record_layer_outputs(model)
        model(**batch)[1].backward()
        assert seen == [False] * 4                 # 2 encoder and 2 decoder layers ran, nothing kept
        graded = {n for n, p in model.named_parameters() if p.grad is not None}
        assert graded == set(trainable)
        assert all(n.startswith(("side_in.", "side_out.", "classification_head.")) or ".side." in n
                   for n in trainable)


@pytest.mark.parametrize("family,method", [("t5", "side"), ("bart", "side_only")])
def test_export_resumes(tiny_lm_dir, tmp_path, family, method):
    """export_peft writes the trained tensors under Hugging Face-style names; apply_peft(state=...)
    puts them back."""
    from safetensors.torch import load_file
    model_dir = tiny_lm_dir(family)
    model, trainable = serial(model_dir, method)
    opt = torch.optim.SGD(trainable.values(), lr=0.5)
    for step in range(2):
        model(**tiny_seq2seq_batch(step))[1].backward()
        opt.step(), opt.zero_grad()
    export_peft(model, str(tmp_path), base_model_path=model_dir, lead=True)
    state = load_file(str(tmp_path / "peft_model.safetensors"))
    assert "side.input.source.weight" in state and any(k.startswith("side.decoder.") for k in state)
    again = build_model(model_dir, Plan(), serial_group(SEQ2SEQ_SHARES[1]))
    apply_peft(again, OPTIONS[method], seed=99, state=state)
    with torch.no_grad():
        assert torch.equal(model(**tiny_seq2seq_batch(5))[0], again(**tiny_seq2seq_batch(5))[0])
