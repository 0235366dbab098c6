"""Bottleneck adapters and ladder side-tuning: the same training under every layout.

Under Galaxy plans at world 2 with uneven shares (both CON layouts, TP and SP sub-blocks; BERT, and
Llama under the Galaxy plan), under DP (dp 2) and PP (pp 2; pp 2 x Galaxy 2 and Llama pp 2 for
side-tuning, whose side state travels between stages; Llama adapters and side-tuning under dp 2
and pp 2), the loss of each of 5 SGD steps and every trained tensor
at the end (gathered to full shape) match galaxy's serial run with the same seed within 1e-5
relative. At step 0 an adapter model and a use_side model compute the base model's logits bit
for bit (zero-initialised up-projections). Side-only never runs the backbone's layers, and
use_side runs the backbone without autograd; frozen weights get no gradient.
"""
from dataclasses import replace

import pytest
import torch

from support.peft_runners import (base_outputs_kept, mesh_vs_serial, peft_plan_vs_serial, record_layer_outputs,
                                  serial_group)
from support.tiny_models import TINY_SEQ, make_tiny_llama, tiny_batch, tiny_lm_batch

from galaxy.runtime.assemble import build_model
from galaxy.plan import Plan
from galaxy.peft import PeftOptions, apply_peft, export_peft

UNEVEN_2 = ((4, 2), (64, 32), (7, 5))          # tiny BERT: 6 heads, 96 columns, 12 tokens
SERIAL = ((6,), (96,), (TINY_SEQ,))
PLANS = {"galaxy": Plan("TP", "TP", "SP"), "tp": Plan("TP", "TP", "None"),
         "sp": Plan("SP", "SP", "SP"), "galaxy2": Plan("TP", "SP", "SP")}
OPTIONS = {"adapter": PeftOptions("adapter", adapter_reduction_dim=8, non_linearity="gelu"),
           "side": PeftOptions("side", side_reduction_factor=4),
           "side_only": PeftOptions("side_only", side_reduction_factor=4)}
TOL = 1e-5


def check(report, rank):
    assert max(report["loss"]) < TOL, f"rank {rank}: losses off by {report['loss']}"
    assert report["tensors"][0] < TOL, f"rank {rank}: {report['tensors'][1]} off by {report['tensors'][0]}"
    if "logits" in report:
        assert report["logits"] < TOL, f"rank {rank}: logits off by {report['logits']}"


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("method", list(OPTIONS))
def test_plan_matches_serial(dist_pool, tiny_bert_dir, method, plan):
    reports = dist_pool(2).run(peft_plan_vs_serial, tiny_bert_dir, PLANS[plan], UNEVEN_2, OPTIONS[method],
                               tiny_batch)
    for rank, report in enumerate(reports):
        check(report, rank)


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    return make_tiny_llama(str(tmp_path_factory.mktemp("llama")))


@pytest.mark.parametrize("method", list(OPTIONS))
def test_llama_galaxy_matches_serial(dist_pool, tiny_llama_dir, method):
    """Causal masks in the side network's attention; pre-norm CONs with adapters. In 2 batch streams
    (side-tuning runs one: its backbone runs without autograd)."""
    reports = dist_pool(2).run(peft_plan_vs_serial, tiny_llama_dir, replace(PLANS["galaxy"], batch_streams=2),
                               ((6, 2), (64, 32), (7, 5)),
                               OPTIONS[method], tiny_lm_batch)
    for rank, report in enumerate(reports):
        check(report, rank)


MESHES = [("adapter", 1, 2), ("adapter", 2, 1), ("side", 1, 2), ("side", 2, 1), ("side_only", 2, 1)]


@pytest.mark.parametrize("method,pp,dp", MESHES, ids=[f"{m}-pp{pp}-dp{dp}" for m, pp, dp in MESHES])
def test_mesh_matches_serial(dist_pool, tiny_bert_dir, method, pp, dp):
    reports = dist_pool(2).run(mesh_vs_serial, tiny_bert_dir, Plan(), pp, dp, SERIAL, OPTIONS[method],
                               tiny_batch)
    for rank, report in enumerate(reports):
        check(report, rank)


SHARDED = [("adapter", "full"), ("side", "no_reshard"), ("side_only", "full")]


@pytest.mark.parametrize("method,sharding", SHARDED, ids=[f"{m}-{s}" for m, s in SHARDED])
def test_sharded_replicas_match_serial(dist_pool, tiny_bert_dir, method, sharding):
    """dp 2 with dp_sharding: side-tuning's backbone runs without autograd (its layers gather and
    never reduce), side-only never runs it, and the ladder's 0-d gates stay whole (FSDP cannot
    shard them) with their gradients averaged over the replicas."""
    reports = dist_pool(2).run(mesh_vs_serial, tiny_bert_dir, Plan(), 1, 2, SERIAL, OPTIONS[method],
                               tiny_batch, 5, 0.5, 8, 2, sharding)
    for rank, report in enumerate(reports):
        check(report, rank)


@pytest.mark.parametrize("method", ["side", "side_only"])
def test_pipeline_of_galaxy_groups_matches_serial(dist_pool, tiny_bert_dir, method):
    """pp 2 x Galaxy 2 (CON SP, uneven): the side state travels sequence-sharded between stages."""
    reports = dist_pool(4).run(mesh_vs_serial, tiny_bert_dir, PLANS["galaxy"], 2, 1, UNEVEN_2, OPTIONS[method],
                               tiny_batch)
    for rank, report in enumerate(reports):
        check(report, rank)


LLAMA_MESHES = [("adapter", 1, 2), ("adapter", 2, 1), ("side", 1, 2), ("side", 2, 1), ("side_only", 2, 1)]


@pytest.mark.parametrize("method,pp,dp", LLAMA_MESHES, ids=[f"{m}-pp{pp}-dp{dp}" for m, pp, dp in LLAMA_MESHES])
def test_llama_mesh_matches_serial(dist_pool, tiny_llama_dir, method, pp, dp):
    reports = dist_pool(2).run(mesh_vs_serial, tiny_llama_dir, Plan(), pp, dp, ((8,), (96,), (TINY_SEQ,)),
                               OPTIONS[method], tiny_lm_batch)
    for rank, report in enumerate(reports):
        check(report, rank)


@pytest.mark.parametrize("method", ["adapter", "side"])
def test_step_zero_is_the_base_model(dist_pool, tiny_bert_dir, method):
    assert dist_pool(1).run(base_outputs_kept, tiny_bert_dir, Plan(), SERIAL, OPTIONS[method], tiny_batch)[0]
    assert all(dist_pool(2).run(base_outputs_kept, tiny_bert_dir, PLANS["galaxy"], UNEVEN_2, OPTIONS[method],
                                tiny_batch))


def serial(model_dir, method):
    model = build_model(model_dir, Plan(), serial_group(SERIAL), num_labels=3)
    return model, apply_peft(model, OPTIONS[method], seed=0)


def test_side_only_skips_the_backbone_layers(tiny_bert_dir):
    model, trainable = serial(tiny_bert_dir, "side_only")
    seen = record_layer_outputs(model)
    _, loss = model(**tiny_batch(0))
    loss.backward()
    assert seen == []                                   # no backbone layer ran
    assert all(p.grad is not None for p in trainable.values())
    assert "not run" in model.attached.peft.description


def test_side_runs_the_backbone_without_autograd(tiny_bert_dir):
    model, trainable = serial(tiny_bert_dir, "side")
    seen = record_layer_outputs(model)
    _, loss = model(**tiny_batch(0))
    loss.backward()
    assert seen == [False, False]                       # both layers ran, nothing kept for backward
    graded = {n for n, p in model.named_parameters() if p.grad is not None}
    assert graded == set(trainable) and "classifier.weight" in graded
    assert not any(n.startswith(("embeddings.", "layers.0.att", "pooler.")) for n in trainable)


def test_adapters_freeze_the_backbone(tiny_bert_dir):
    model, trainable = serial(tiny_bert_dir, "adapter")
    model(**tiny_batch(0))[1].backward()
    assert {n for n, p in model.named_parameters() if p.grad is not None} == set(trainable)
    assert sorted({n.split(".")[2] for n in trainable if n.startswith("layers.")}) == ["con1", "con2"]


@pytest.mark.parametrize("method", list(OPTIONS))
def test_export_resumes(tiny_bert_dir, tmp_path, method):
    """export_peft writes the trained tensors; apply_peft(state=...) puts them back."""
    from safetensors.torch import load_file
    model, trainable = serial(tiny_bert_dir, method)
    opt = torch.optim.SGD(trainable.values(), lr=0.5)
    for step in range(2):
        model(**tiny_batch(step))[1].backward()
        opt.step(), opt.zero_grad()
    export_peft(model, str(tmp_path), base_model_path=tiny_bert_dir, lead=True)
    again = build_model(tiny_bert_dir, Plan(), serial_group(SERIAL), num_labels=3)
    apply_peft(again, OPTIONS[method], seed=99, state=load_file(str(tmp_path / "peft_model.safetensors")))
    assert (tmp_path / "galaxy_peft.json").exists()
    with torch.no_grad():
        assert torch.equal(model(**tiny_batch(5))[0], again(**tiny_batch(5))[0])


def stage(model_dir, method, layers, first, last):
    from galaxy.pipeline.stage import keep_stage
    model = build_model(model_dir, Plan(), serial_group(SERIAL), num_labels=3)
    keep_stage(model, layers, first, last)
    return model, apply_peft(model, OPTIONS[method], seed=0)


@pytest.mark.parametrize("method", ["side", "side_only"])
def test_pipeline_stages_split_the_side_network(tiny_bert_dir, method):
    """The stages' side parameters are exactly the serial model's, each on one stage, same values;
    what travels: the backbone stream without gradient (side) or nothing of it (side-only)."""
    from galaxy.pipeline.stage import CarrySlot, carry_slots
    _, whole = serial(tiny_bert_dir, method)
    first, first_trainable = stage(tiny_bert_dir, method, range(0, 1), True, False)
    last, last_trainable = stage(tiny_bert_dir, method, range(1, 2), False, True)
    assert not set(first_trainable) & set(last_trainable)
    assert set(first_trainable) | set(last_trainable) == set(whole)
    for name, p in {**first_trainable, **last_trainable}.items():
        assert torch.equal(p, whole[name]), name
    assert first.side_out is None and last.side_in is None
    width = first.side_width
    backbone = None if method == "side_only" else CarrySlot(first.config.hidden_size, False)
    assert carry_slots(first) == (backbone, CarrySlot(width, True)) == carry_slots(last)
