"""A Llama sequence classifier (task: classification with a Llama model) under every per-sub-block
plan trains exactly like HF LlamaForSequenceClassification.

Tiny Llama (grouped-query attention) with a 3-class `score` head, right-padded rows whose last
tokens (the pooled ones) fall on different sequence shards: all 8 ATT x MLP x CON plans at world 2
with uneven shares, the Galaxy and SP plans at world 3, serial, and a 2-stage pipeline with
micro-batches of different lengths: logits, loss, every gathered gradient, 5 SGD steps' losses
and the final gathered weights within 1e-5 relative (fp32).
"""
import itertools

import pytest

from support.parity import check_report
from support.parity_runners import export_and_reload_classifier, train_plan_and_compare, train_runner_and_compare
from support.tiny_models import TINY_SEQ, make_tiny_llama_classifier, tiny_cls_batch

from galaxy.plan import Plan

COMBOS = list(itertools.product(("TP", "SP"), ("TP", "SP"), ("SP", "None")))
UNEVEN_2 = ((6, 2), (64, 32), (7, 5))          # query heads, MLP columns, tokens
UNEVEN_3 = ((4, 2, 2), (40, 32, 24), (5, 4, 3))
# At the causal-LM tests' lr 0.5 this 3-row classifier's trajectory amplifies rounding: serial
# galaxy and HF, whose step-0 gradients agree to 2e-7, end 3e-5 apart in the embeddings after 5
# steps. At 0.1 the comparison measures the plans, not that amplification.
STEPS, LR = 5, 0.1


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory):
    return make_tiny_llama_classifier(str(tmp_path_factory.mktemp("tiny_llama_cls")))


@pytest.mark.parametrize("att,mlp,con", COMBOS, ids=[f"att{a}-mlp{m}-con{c}" for a, m, c in COMBOS])
def test_plan_matches_hf_world2_uneven(dist_pool, classifier_dir, att, mlp, con):
    reports = dist_pool(2).run(train_plan_and_compare, "llama", classifier_dir, Plan(att, mlp, con),
                               UNEVEN_2, tiny_cls_batch, STEPS, LR, {"task": "classification"})
    for rank, report in enumerate(reports):
        check_report(report, rank)


@pytest.mark.parametrize("att,mlp,con", [("TP", "TP", "SP"), ("SP", "SP", "SP")], ids=["galaxy", "sp"])
def test_plan_matches_hf_world3(dist_pool, classifier_dir, att, mlp, con):
    reports = dist_pool(3).run(train_plan_and_compare, "llama", classifier_dir, Plan(att, mlp, con),
                               UNEVEN_3, tiny_cls_batch, STEPS, LR, {"task": "classification"})
    for rank, report in enumerate(reports):
        check_report(report, rank)


def test_serial_matches_hf(dist_pool, classifier_dir):
    report = dist_pool(1).run(train_plan_and_compare, "llama", classifier_dir, Plan(),
                              ((8,), (96,), (TINY_SEQ,)), tiny_cls_batch, STEPS, LR, {"task": "classification"})[0]
    check_report(report, 0)


def test_pipeline_matches_hf(dist_pool, classifier_dir):
    """pp 2, 4 micro-batches of 2 rows: the head pools each micro-batch's own rows."""
    reports = dist_pool(2).run(train_runner_and_compare, "llama", classifier_dir, Plan(), 2, 1,
                               ((8,), (96,), (TINY_SEQ,)), tiny_cls_batch,
                               {"num_microbatches": 4, "task": "classification", "lr": LR})
    for rank, report in enumerate(reports):
        check_report(report, rank)


def export_and_reload(model_dir, out_dir):
    """Galaxy plan at world 2 -> export_hf -> HF LlamaForSequenceClassification: the same logits."""
    from transformers import LlamaForSequenceClassification

    from support.parity import world_group
    return export_and_reload_classifier(model_dir, out_dir, Plan("TP", "TP", "SP"), world_group(*UNEVEN_2),
                                        tiny_cls_batch(seed=3), LlamaForSequenceClassification)


def test_export_loads_in_hf(dist_pool, classifier_dir, tmp_path):
    for err, architectures, labels in dist_pool(2).run(export_and_reload, classifier_dir, str(tmp_path / "export")):
        assert err < 1e-5 and architectures == ["LlamaForSequenceClassification"]
        assert labels == {0: "a", 1: "b", 2: "c"}
