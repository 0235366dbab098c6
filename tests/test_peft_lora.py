"""LoRA trains exactly like peft's LoRA on Hugging Face's model, and speaks peft's format.

Both start from one peft adapter directory (random non-zero A and B, a trained classifier; r 4,
alpha 8 on query, value and every "dense": column-parallel, row-parallel and replicated
projections). Under all 8 per-sub-block plans at world 2 with uneven shares, serially, under DP
(dp 2) and PP (pp 2, 1f1b), for BERT and Llama (Qwen2, Llama with q/k/v biases: the Galaxy
plan and pp 2), the loss of each of 5 SGD steps and, at the end, every tensor peft
would save (lora_A, lora_B, the classifier; gathered to full shape) match peft within 1e-5
relative. Frozen weights get no gradient and no optimizer state. The exported directory loads
with PeftModel.from_pretrained and gives galaxy's logits; merge_lora gives a plain HF checkpoint
with the same logits.
"""
import itertools
import json

import pytest
import torch

from parity import hf_bert, rel_err, world_group
from peft_runners import lora_mesh_vs_peft, lora_plan_vs_peft, write_peft_adapter
from tiny_models import TINY_SEQ, tiny_batch, tiny_lm_batch

from galaxy.distributed.group import GalaxyGroup
from galaxy.runtime.assemble import build_model
from galaxy.parallel.plan import ParallelPlan
from galaxy.peft import PeftOptions, apply_peft, export_peft

COMBOS = list(itertools.product(("TP", "SP"), ("TP", "SP"), ("SP", "None")))
UNEVEN_2 = ((4, 2), (64, 32), (7, 5))          # tiny BERT: 6 heads, 96 columns, 12 tokens
SERIAL = ((6,), (96,), (TINY_SEQ,))
TOL = 1e-5


@pytest.fixture(scope="module")
def adapter_dir(tiny_bert_dir, tmp_path_factory):
    return write_peft_adapter("bert", tiny_bert_dir, str(tmp_path_factory.mktemp("lora")),
                              ["query", "value", "dense"])


def check(report, rank):
    assert max(report["loss"]) < TOL, f"rank {rank}: losses off by {report['loss']}"
    assert report["tensors"][0] < TOL, f"rank {rank}: {report['tensors'][1]} off by {report['tensors'][0]}"
    if "logits" in report:
        assert report["logits"] < TOL, f"rank {rank}: logits off by {report['logits']}"
        assert report["frozen_grads"] == [], f"rank {rank}: frozen weights got gradients"


@pytest.mark.parametrize("att,mlp,con", COMBOS, ids=[f"att{a}-mlp{m}-con{c}" for a, m, c in COMBOS])
def test_plan_matches_peft(dist_pool, tiny_bert_dir, adapter_dir, att, mlp, con):
    reports = dist_pool(2).run(lora_plan_vs_peft, "bert", tiny_bert_dir, adapter_dir,
                               ParallelPlan(att, mlp, con), UNEVEN_2, tiny_batch)
    for rank, report in enumerate(reports):
        check(report, rank)


def test_serial_matches_peft(dist_pool, tiny_bert_dir, adapter_dir):
    check(dist_pool(1).run(lora_plan_vs_peft, "bert", tiny_bert_dir, adapter_dir, ParallelPlan(),
                           SERIAL, tiny_batch)[0], 0)


@pytest.mark.parametrize("pp,dp,sharding", [(1, 2, "none"), (2, 1, "none"), (1, 2, "full")],
                         ids=["dp2", "pp2", "dp2-sharded"])
def test_mesh_matches_peft(dist_pool, tiny_bert_dir, adapter_dir, pp, dp, sharding):
    """dp2-sharded: FSDP shards the frozen base weights and the LoRA tensors alike."""
    reports = dist_pool(2).run(lora_mesh_vs_peft, "bert", tiny_bert_dir, adapter_dir, ParallelPlan(), pp, dp,
                               SERIAL, tiny_batch, 5, 0.1, 8, 2, sharding)
    for rank, report in enumerate(reports):
        check(report, rank)


@pytest.fixture(scope="module")
def llama_lora(tiny_lm_dir, tmp_path_factory):
    """llama_lora(family) -> (tiny 3-layer model of that Llama-shaped family, a peft adapter on
    every attention and MLP projection but gate), written once per family."""
    made = {}

    def get(family):
        if family not in made:
            model_dir = tiny_lm_dir(family, num_hidden_layers=3)
            made[family] = model_dir, write_peft_adapter(
                family, model_dir, str(tmp_path_factory.mktemp(f"{family}_lora")),
                ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"])
        return made[family]
    return get


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_llama_galaxy_matches_peft(dist_pool, llama_lora, family):
    reports = dist_pool(2).run(lora_plan_vs_peft, family, *llama_lora(family), ParallelPlan.preset("galaxy"),
                               ((6, 2), (64, 32), (7, 5)), tiny_lm_batch)
    for rank, report in enumerate(reports):
        check(report, rank)


@pytest.mark.parametrize("family,pp,dp", [("llama", 1, 2), ("llama", 2, 1), ("qwen2", 2, 1)],
                         ids=["llama-dp2", "llama-pp2", "qwen2-pp2"])
def test_llama_mesh_matches_peft(dist_pool, llama_lora, family, pp, dp):
    """Causal LM: the loss weighted by label tokens across replicas and micro-batches."""
    reports = dist_pool(2).run(lora_mesh_vs_peft, family, *llama_lora(family), ParallelPlan(), pp, dp,
                               ((8,), (96,), (TINY_SEQ,)), tiny_lm_batch)
    for rank, report in enumerate(reports):
        check(report, rank)


def train_and_export(model_dir, adapter_dir, out_dir, merge):
    """2 SGD steps under the Galaxy plan, export; returns the logits of a held-out batch."""
    torch.manual_seed(0)
    group = world_group(*UNEVEN_2)
    model = build_model(model_dir, ParallelPlan.preset("galaxy"), group, num_labels=3)
    trainable = apply_peft(model, PeftOptions("lora", lora_path=adapter_dir), seed=0)
    from galaxy.parallel.grad_sync import GradientSync
    sync, opt = GradientSync(model, group.pg), torch.optim.SGD(trainable.values(), lr=0.1)
    for step in range(2):
        model(**tiny_batch(seed=step))[1].backward()
        sync()
        opt.step(), opt.zero_grad()
    export_peft(model, out_dir, base_model_path=model_dir, lead=group.rank == 0, merge=merge,
                class_names=["a", "b", "c"])
    with torch.no_grad():
        return model.eval()(**tiny_batch(seed=9))[0]


def test_export_loads_in_peft(dist_pool, tiny_bert_dir, adapter_dir, tmp_path):
    from peft import PeftModel
    logits = dist_pool(2).run(train_and_export, tiny_bert_dir, adapter_dir, str(tmp_path / "out"), False)[0]
    config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["task_type"], config["r"]) == ("LORA", "SEQ_CLS", 4)
    ref = PeftModel.from_pretrained(hf_bert(tiny_bert_dir), str(tmp_path / "out")).eval()
    with torch.no_grad():
        assert rel_err(logits, ref(**tiny_batch(seed=9)).logits) < TOL


def test_merged_export_is_a_plain_hf_checkpoint(dist_pool, tiny_bert_dir, adapter_dir, tmp_path):
    from transformers import BertForSequenceClassification
    logits = dist_pool(2).run(train_and_export, tiny_bert_dir, adapter_dir, str(tmp_path / "merged"), True)[0]
    assert not (tmp_path / "merged" / "adapter_config.json").exists()
    ref = BertForSequenceClassification.from_pretrained(str(tmp_path / "merged")).eval()
    with torch.no_grad():
        assert rel_err(logits, ref(**tiny_batch(seed=9)).logits) < TOL


def serial_model(model_dir, **options):
    model = build_model(model_dir, ParallelPlan(), GalaxyGroup.serial(6, 96, TINY_SEQ), num_labels=3)
    return model, apply_peft(model, PeftOptions("lora", **options), seed=3)


def test_defaults_adapt_query_and_value_and_train_the_classifier(tiny_bert_dir):
    model, trainable = serial_model(tiny_bert_dir)
    lora = sorted({n.split(".")[3] for n in trainable if ".lora_" in n})
    assert lora == ["query", "value"]
    assert {n for n in trainable if ".lora_" not in n} == {"classifier.weight", "classifier.bias"}
    # B starts at zero: the model computes the base model's logits.
    base = build_model(tiny_bert_dir, ParallelPlan(), GalaxyGroup.serial(6, 96, TINY_SEQ), num_labels=3)
    assert torch.equal(base(**tiny_batch(0))[0], model(**tiny_batch(0))[0])
    # Frozen weights: no gradient, no optimizer state.
    opt = torch.optim.AdamW(trainable.values())
    model(**tiny_batch(0))[1].backward()
    opt.step()
    params = dict(model.named_parameters())
    assert {n for n, p in params.items() if p.grad is not None} == set(trainable)
    assert {id(p) for p in opt.state} == {id(p) for p in trainable.values()}


def test_adapter_directory_wins_over_options(tiny_bert_dir, adapter_dir):
    model, _ = serial_model(tiny_bert_dir, lora_dim=16, lora_alpha=1.0, lora_target_modules=["key"],
                            lora_path=adapter_dir)
    assert (model.attached.peft.lora.r, model.attached.peft.lora.alpha) == (4, 8.0)
    assert model.layers[0].att.query.lora_A.weight.shape == (4, 48)
    assert not hasattr(model.layers[0].att.key, "lora_A")


def test_refuses_adapters_it_cannot_compute(tiny_bert_dir, adapter_dir, tmp_path):
    import shutil
    bad = tmp_path / "dora"
    shutil.copytree(adapter_dir, bad)
    config = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora"):
        serial_model(tiny_bert_dir, lora_path=str(bad))
    with pytest.raises(ValueError, match="match no projection"):
        serial_model(tiny_bert_dir, lora_target_modules=["q_proj"])
    with pytest.raises(ValueError, match="output head"):
        serial_model(tiny_bert_dir, lora_target_modules=["classifier"])


def test_exactly_one_method():
    from types import SimpleNamespace
    with pytest.raises(ValueError, match="use_lora and use_side"):
        PeftOptions.from_config(SimpleNamespace(use_lora=True, use_side=True))
    opts = PeftOptions.from_config(SimpleNamespace(use_lora=True, lora_dim=4, lora_target_modules=["query"]))
    assert (opts.method, opts.lora_dim, opts.lora_target_modules) == ("lora", 4, ("query",))
    assert PeftOptions.from_config(SimpleNamespace()).method == "full"
    with pytest.raises(ValueError, match="full_model is false"):
        PeftOptions.from_config(SimpleNamespace(full_model=False, _given=frozenset({"full_model"})))
