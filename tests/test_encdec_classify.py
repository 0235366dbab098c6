"""BART and T5 sequence classifiers (task: classification) train exactly like Hugging Face's
BartForSequenceClassification and T5ForSequenceClassification.

The tiny encoder-decoders of test_parity_encdec.py with a 3-class classification_head (non-zero
biases), on right-padded source rows of 12 tokens with two EOS tokens each, the pooled one last
(positions 11, 7 and 3): the decoder reads the source shifted right, so its token shares split 12
tokens too, here 5 / 7 against the encoder's 7 / 5, and under CON SP the pooled tokens sit on both
ranks. At world 2 the 8 ATT x MLP x CON plans (XATT as in test_parity_encdec.py) with uneven heads,
MLP columns and tokens, world 3, serial, DP 2: logits, loss, every gathered gradient, 5 SGD steps'
losses and the final gathered weights within 1e-5 relative (fp32). As pipelines (pp 2, a boundary
inside the encoder and one between the stacks, 2 and 4 micro-batches; pp 2 x Galaxy 2 under CON
SP) the same quantities, the last stage pooling at positions the runner takes off the source
ids. LoRA (SEQ_CLS, the head
trained in full) against peft; exports load in Hugging Face's classes; a ...ForConditionalGeneration
checkpoint gets a new head, drawn from the seed, and then trains like Hugging Face's classifier
given that head.
"""
import itertools

import pytest

from support.parity import check_labelled_reports, check_report
from support.parity_runners import (export_and_reload_classifier, train_plans_and_compare,
                                     train_runner_and_compare, train_runners_and_compare)
from support.peft_runners import lora_plan_vs_peft, write_peft_adapter
from support.tiny_models import (TINY_SEQ, tiny_encdec_cls_batch,
                                 tiny_t5_cls_batch)

from galaxy.config.world import workload
from galaxy.plan import Plan

BATCHES = {"bart": tiny_encdec_cls_batch, "t5": tiny_t5_cls_batch}
CLASSIFY = {"task": "classification"}
LORA_LR = 0.05


def xatt_of(att, mlp, con):
    """XATT's method in the half fraction of the 2^4 plans that covers every pair of methods."""
    return "TP" if (att == mlp) == (con == "SP") else "SP"


COMBOS = [(a, m, c, xatt_of(a, m, c)) for a, m, c in itertools.product(("TP", "SP"), ("TP", "SP"), ("SP", "None"))]
SHARES = {   # heads, MLP columns, source tokens, decoder tokens (the source shifted: 12 as well)
    2: ((3, 1), (64, 32), (7, 5), (5, 7)),
    3: ((2, 1, 1), (40, 32, 24), (5, 4, 3), (3, 5, 4)),
    1: ((4,), (96,), (TINY_SEQ,), (TINY_SEQ,)),
}
WORLD3 = [("TP", "TP", "SP", "TP"), ("SP", "SP", "SP", "SP")]


def plan_of(case):
    return Plan(*case[:3], xatt=case[3]) if case else Plan()


def run(dist_pool, world, family, model_dir, cases):
    plans = [plan_of(case) for case in cases]
    ranks = dist_pool(world).run(train_plans_and_compare, family, model_dir, plans, SHARES[world], BATCHES[family],
                                 CLASSIFY)
    check_labelled_reports(ranks, [f"{family} {case or 'serial'}" for case in cases])


@pytest.mark.parametrize("family", ("bart", "t5"))
def test_world2_uneven_plans_match_hf(dist_pool, encdec_classifier_dir, family):
    run(dist_pool, 2, family, encdec_classifier_dir(family), COMBOS)


@pytest.mark.parametrize("family", ("bart", "t5"))
def test_world3_and_serial_match_hf(dist_pool, encdec_classifier_dir, family):
    run(dist_pool, 3, family, encdec_classifier_dir(family), WORLD3)
    run(dist_pool, 1, family, encdec_classifier_dir(family), [()])


@pytest.mark.parametrize("family", ("bart", "t5"))
def test_dp2_matches_hf(dist_pool, encdec_classifier_dir, family):
    """Two replicas under DDP, 4 rows each, against HF on the global batch of 8."""
    for rank, report in enumerate(dist_pool(2).run(train_runner_and_compare, family, encdec_classifier_dir(family), Plan(),
                                                   1, 2, SHARES[1], BATCHES[family], CLASSIFY)):
        check_report(report, rank)


@pytest.mark.parametrize("family,targets,case", [("bart", ["q_proj", "v_proj"], ("TP", "TP", "SP", "SP")),
                                                 ("t5", ["q", "v", "wo"], ("SP", "TP", "SP", "TP"))])
def test_lora_matches_peft(dist_pool, encdec_classifier_dir, tmp_path, family, targets, case):
    """LoRA from one random peft SEQ_CLS adapter (classification_head in modules_to_save): losses,
    logits, and the adapter's tensors and head after 5 SGD steps equal peft's on HF's classifier.
    At lr 0.1 the T5 adapter's 3-row trajectory amplifies rounding: after one step every tensor is
    within 2e-7 of peft's, after 5 the encoder's q.lora_B 2.5e-5 apart (lr 0.05: 1.3e-6; 0.02:
    3e-7; serially 0), so the steps run at 0.05."""
    model_dir = encdec_classifier_dir(family)
    adapter = write_peft_adapter(family, model_dir, str(tmp_path / "lora"), targets, task="classification")
    for rank, report in enumerate(dist_pool(2).run(lora_plan_vs_peft, family, model_dir, adapter, plan_of(case),
                                                   SHARES[2], BATCHES[family], 5, LORA_LR, "classification")):
        assert max(report["loss"]) < 1e-5 and report["logits"] < 1e-5, (rank, report["loss"], report["logits"])
        assert report["tensors"][0] < 1e-5, (rank, report["tensors"])
        assert report["frozen_grads"] == [], (rank, report["frozen_grads"])


def export_and_reload(family, model_dir, out_dir):
    """A Galaxy plan at world 2 -> export_hf -> HF's ...ForSequenceClassification: the same logits."""
    import torch.distributed as dist
    from transformers import AutoModelForSequenceClassification

    from galaxy.distributed.group import GalaxyGroup
    group = GalaxyGroup(dist.get_rank(), 2, dist.group.WORLD, *SHARES[2])
    return export_and_reload_classifier(model_dir, out_dir, Plan("SP", "TP", "SP", xatt="TP"), group,
                                        BATCHES[family](seed=3), AutoModelForSequenceClassification)


@pytest.mark.parametrize("family", ("bart", "t5"))
def test_export_loads_in_hf(dist_pool, encdec_classifier_dir, tmp_path, family):
    out = str(tmp_path / "export")
    for err, architectures, labels in dist_pool(2).run(export_and_reload, family, encdec_classifier_dir(family), out):
        assert err < 1e-5, err
        assert architectures == [f"{'Bart' if family == 'bart' else 'T5'}ForSequenceClassification"]
        assert labels == {0: "a", 1: "b", 2: "c"}


def new_head_matches_hf(family, condgen_dir, batch_fn):
    """Galaxy's classifier built from a ...ForConditionalGeneration folder (no head: drawn from the
    seed) against HF's classifier from the same folder given galaxy's drawn head, under a CON SP
    plan at world 2: the report of train_runner_and_compare, and the drawn head's biases."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from support.parity import rel_err, worst_param_error
    from support.parity_runners import DEFAULTS, hf_forward, train_and_compare
    ref = AutoModelForSequenceClassification.from_pretrained(condgen_dir, num_labels=3).train()
    ref.config.architectures = [type(ref).__name__]      # HF's names for this class (T5: "transformer.")
    drawn = {}

    @torch.no_grad()
    def adopt_head(model):     # the head is replicated under every plan: whole on each rank
        for name, p in model.classification_head.named_parameters():
            drawn[name] = p.detach().clone()
            ref.classification_head.get_parameter(name).copy_(p)

    def grads(runner, mesh):
        ref_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref.parameters()]))
        return {"grad": worst_param_error(runner.full_state(grads=True), ref, True, family),
                "grad_norm": rel_err(runner.grad_norm(), ref_norm)}
    o = {**DEFAULTS, "global_batch": None, "lr": 0.1, "task": "classification", "adapt": adopt_head}
    report = train_and_compare(condgen_dir, Plan("TP", "SP", "SP", xatt="SP"), SHARES[2], batch_fn,
                               (hf_forward(ref), ref.parameters()), o, grads)
    report["weights"] = worst_param_error(report.pop("runner").full_state(), ref, False, family)
    del report["mesh"]
    report["biases"] = [drawn[n].abs().max().item() for n in ("dense.bias", "out_proj.bias")]
    report["weight_std"] = drawn["out_proj.weight"].std().item()
    return report


@pytest.mark.parametrize("family", ("bart", "t5"))
def test_conditional_generation_checkpoint_trains_a_new_head(dist_pool, tiny_lm_dir, family):
    for rank, report in enumerate(dist_pool(2).run(new_head_matches_hf, family, tiny_lm_dir(family),
                                                   BATCHES[family])):
        check_report(report, rank)
        assert report["biases"] == [0.0, 0.0] and 0.01 < report["weight_std"] < 0.03, report


def test_a_head_of_other_classes_is_refused_or_replaced(encdec_classifier_dir, tiny_lm_dir):
    """A checkpoint's 3-class head for a 2-class task: one line naming its out_proj, unless
    ignore_mismatched_sizes, which keeps dense and draws a new out_proj (zero bias). A
    ...ForConditionalGeneration checkpoint has no head: a new one, no error."""
    import torch

    from galaxy.config import ConfigError
    from galaxy.distributed.group import GalaxyGroup
    from galaxy.preflight.weights import check_weights
    from galaxy.runtime.assemble import build_model
    from galaxy.train.head import replace_classifier
    model_dir = encdec_classifier_dir("t5")
    msg = str(pytest.raises(ConfigError, check_weights, model_dir, "model_path", 2, task="classification").value)
    assert "its classifier (classification_head.out_proj.weight in model.safetensors) has 3 outputs but the task " \
           "has 2 classes" in msg, msg
    facts, _ = check_weights(model_dir, "model_path", 2, reinit_head=True, task="classification")
    assert (facts.head_rows, facts.new_head) == (3, True)
    for family in ("bart", "t5"):
        facts, model = check_weights(tiny_lm_dir(family), "model_path", 2, task="classification")
        assert (facts.head_rows, facts.new_head, model.task) == (None, True, "classification")
    model = build_model(model_dir, Plan(), GalaxyGroup.serial(4, 96, TINY_SEQ), num_labels=3, task="classification")
    dense = model.classification_head.dense.weight.detach().clone()
    replace_classifier(model, 2, seed=0)
    head = model.classification_head
    assert head.out_proj.weight.shape == (2, 48) and not head.out_proj.bias.any() and model.num_labels == 2
    assert torch.equal(head.dense.weight, dense)


def test_target_pad_size_is_refused_for_a_classifier(tmp_path):
    import json

    from galaxy.config import ConfigError, load_config
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"model_path": str(tmp_path), "task": "classification", "target_pad_size": 8}))
    msg = str(pytest.raises(ConfigError, load_config, path).value)
    assert "target_pad_size is set but task is classification" in msg and "remove target_pad_size" in msg, msg


def test_a_classifier_pipeline_passes_the_checks(tmp_path):
    """task classification with pp_deg 2 on T5 is a config that trains (the parity tests below)."""
    import json

    from galaxy.config import load_config, validate_for_world
    from galaxy.models.shape import read_model_shape
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"model_path": "models/tiny-t5", "task": "classification", "pad_size": 16,
                                "pp_deg": 2, "stage_num_hidden_layers_list": [1, 3], "num_microbatches": 2}))
    cfg = load_config(str(path))
    shape = read_model_shape(cfg.model_path)
    validate_for_world(cfg, 2, 1, shape)
    assert cfg.plan.resolve(2, workload(cfg, shape)).stages == (1, 3)


# --- pipelines: the last stage pools the EOS positions the runner hands it ---------------------------

def pp_cases(family, model_dir):
    """(label, *train_runner_and_compare's arguments): a boundary inside the encoder (both stacks'
    carries travel) and one between the stacks (the encoder's output alone), 2 and 4 micro-batches."""
    return [(f"{family}-pp2-{stages}-{schedule}-mb{n}", family, model_dir, Plan(), 2, 1, SHARES[1], BATCHES[family],
             {**CLASSIFY, "stage_layers": stages, "schedule": schedule, "num_microbatches": n})
            for stages, schedule, n in (([1, 3], "gpipe", 2), ([2, 2], "1f1b", 4))]


def run_pp(pool, cases):
    ranks = pool.run(train_runners_and_compare, [case[1:] for case in cases])
    check_labelled_reports(ranks, [case[0] for case in cases])
    return ranks


def test_pp2_boundaries_inside_and_after_the_encoder_match_hf(dist_pool, encdec_classifier_dir):
    """BART and T5 classifiers as 2-stage pipelines: the last stage's head pools each row's last
    EOS (11, 7, 3, 3, ... of 12) from positions the runner computes off the source ids, per
    micro-batch; loss, logits, every gradient and the weights after 5 SGD steps as HF's."""
    cases = pp_cases("bart", encdec_classifier_dir("bart")) + pp_cases("t5", encdec_classifier_dir("t5"))
    ranks = run_pp(dist_pool(2), cases)
    assert [r["stage"] for r in ranks[1]] == [[1, 2, 3], [2, 3]] * 2


def test_pp2_x_galaxy2_matches_hf(dist_pool, encdec_classifier_dir):
    """Each stage an uneven Galaxy group under CON SP: the last stage's pooled tokens sit on either
    of its ranks (the decoder's 5 / 7 token shares)."""
    plan = Plan("TP", "SP", "SP", xatt="TP")
    cases = [(f"{family}-pp2-galaxy2", family, encdec_classifier_dir(family), plan, 2, 1, SHARES[2], BATCHES[family],
              {**CLASSIFY, "stage_layers": stages, "schedule": "1f1b", "num_microbatches": 2})
             for family, stages in (("t5", [1, 3]), ("bart", [2, 2]))]
    run_pp(dist_pool(4), cases)
