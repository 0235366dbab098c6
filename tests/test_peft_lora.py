"""LoRA trains exactly like peft's LoRA on Hugging Face's model, and speaks peft's format.

Both start from one peft adapter directory (random non-zero A and B, a trained classifier; r 4,
alpha 8 on query, value and every "dense": column-parallel, row-parallel and replicated
projections). Under all 8 per-sub-block plans at world 2 with uneven shares, serially, under DP
(dp 2, even, FSDP2, and uneven rows: dp_batch_list) and PP (pp 2, 1f1b), for BERT and Llama (Qwen2, Llama with q/k/v biases: the Galaxy
plan and pp 2), the loss of each of 5 SGD steps and, at the end, every tensor peft
would save (lora_A, lora_B, the classifier; gathered to full shape) match peft within 1e-5
relative. GPT-2 likewise under the Galaxy plan with heads 3 / 1, LoRA on its Conv1D projections
(c_attn: B's rows sharded per q, k and v block; c_proj; c_fc) from a peft directory peft wrote
(fan_in_fan_out true). Frozen weights get no gradient and no optimizer state. The exported
directory loads with PeftModel.from_pretrained and gives galaxy's logits; merge_lora gives a plain
HF checkpoint with the same logits (BERT, and GPT-2 with its weights transposed back to Conv1D).
"""
import itertools
import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from support.parity import HF_LOADERS, rel_err
from support.peft_runners import lora_mesh_vs_peft, lora_plan_vs_peft, lora_train_and_export, write_peft_adapter
from support.tiny_models import TINY_SEQ, tiny_batch, tiny_lm_batch, tiny_lm_batch_unpadded

from galaxy.distributed.group import GalaxyGroup
from galaxy.runtime.assemble import build_model
from galaxy.plan import Plan
from galaxy.peft import PeftOptions, apply_peft

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
    if "grads" in report:
        assert report["grads"][0] < TOL, f"rank {rank}: {report['grads'][1]}'s gradient off by {report['grads'][0]}"
    if "logits" in report:
        assert report["logits"] < TOL, f"rank {rank}: logits off by {report['logits']}"
        assert report["frozen_grads"] == [], f"rank {rank}: frozen weights got gradients"


@pytest.mark.parametrize("att,mlp,con", COMBOS, ids=[f"att{a}-mlp{m}-con{c}" for a, m, c in COMBOS])
def test_plan_matches_peft(dist_pool, tiny_bert_dir, adapter_dir, att, mlp, con):
    streams = 2 if (att, mlp, con) == ("TP", "TP", "SP") else 1      # the Galaxy plan in 2 batch streams
    reports = dist_pool(2).run(lora_plan_vs_peft, "bert", tiny_bert_dir, adapter_dir,
                               Plan(att, mlp, con, batch_streams=streams), UNEVEN_2, tiny_batch)
    for rank, report in enumerate(reports):
        check(report, rank)


def test_serial_matches_peft(dist_pool, tiny_bert_dir, adapter_dir):
    check(dist_pool(1).run(lora_plan_vs_peft, "bert", tiny_bert_dir, adapter_dir, Plan(),
                           SERIAL, tiny_batch)[0], 0)


@pytest.mark.parametrize("pp,dp,sharding,rows", [(1, 2, "none", (6, 2)), (2, 1, "none", None), (1, 2, "full", None)],
                         ids=["dp2-uneven", "pp2", "dp2-sharded"])
def test_mesh_matches_peft(dist_pool, tiny_bert_dir, adapter_dir, pp, dp, sharding, rows):
    """dp2-uneven: replicas of 6 and 2 rows (dp_batch_list). dp2-sharded: FSDP shards the frozen base
    weights and the LoRA tensors alike."""
    reports = dist_pool(2).run(lora_mesh_vs_peft, "bert", tiny_bert_dir, adapter_dir, Plan(), pp, dp,
                               SERIAL, tiny_batch, 5, 0.1, 8, 2, sharding, None, None, rows)
    for rank, report in enumerate(reports):
        check(report, rank)


# Decoder families: (tiny model overrides, LoRA targets: every attention and MLP projection but
# Llama's gate, so that column-parallel, fused and row-parallel ones are all adapted, uneven
# Galaxy shares at world 2).
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"]
DECODERS = {
    "llama": (dict(num_hidden_layers=3), LLAMA_TARGETS, ((6, 2), (64, 32), (7, 5))),
    "qwen2": (dict(num_hidden_layers=3), LLAMA_TARGETS, ((6, 2), (64, 32), (7, 5))),
    "gpt2": ({}, ["c_attn", "c_proj", "c_fc"], ((3, 1), (120, 72), (7, 5))),
}


# LoRA on some layers only: on 3 layers at pp 2 (stages [2, 1]) the targets of stage 1 alone
# (stage 0 trains nothing and runs no backward) or of stage 0 alone (the last stage trains
# nothing but computes the loss and back-propagates to its input).
LAYER_TARGETS = {"stage1": ["layers.2.self_attn.q_proj", "layers.2.self_attn.v_proj", "layers.2.mlp.down_proj"],
                 "stage0": ["layers.0.self_attn.q_proj", "layers.1.self_attn.o_proj", "layers.1.mlp.up_proj"]}


@pytest.fixture(scope="module")
def decoder_lora(tiny_lm_dir, tmp_path_factory):
    """decoder_lora(family, layers=None) -> (tiny model directory, a peft adapter on DECODERS'
    targets, or on LAYER_TARGETS[layers]), made once per family and targets."""
    made = {}

    def get(family, layers=None):
        if (family, layers) not in made:
            overrides, targets, _ = DECODERS[family]
            model_dir = tiny_lm_dir(family, **overrides)
            made[family, layers] = model_dir, write_peft_adapter(
                family, model_dir, str(tmp_path_factory.mktemp(f"{family}_lora")),
                LAYER_TARGETS[layers] if layers else targets)
        return made[family, layers]
    return get


@pytest.mark.parametrize("family", sorted(DECODERS))
def test_decoder_galaxy_matches_peft(dist_pool, decoder_lora, family):
    reports = dist_pool(2).run(lora_plan_vs_peft, family, *decoder_lora(family), Plan.preset("galaxy"),
                               DECODERS[family][2], tiny_lm_batch)
    for rank, report in enumerate(reports):
        check(report, rank)


@pytest.mark.parametrize("family,pp,dp,layers,galaxy", [
    ("llama", 1, 2, None, False), ("llama", 2, 1, None, False), ("qwen2", 2, 1, None, False),
    ("llama", 2, 1, "stage1", False), ("llama", 2, 1, "stage0", False), ("llama", 2, 1, "stage1", True)],
    ids=["llama-dp2-uneven", "llama-pp2", "qwen2-pp2", "llama-pp2-stage1-targets", "llama-pp2-stage0-targets",
         "llama-pp2xgalaxy2-stage1-targets"])
def test_llama_mesh_matches_peft(dist_pool, decoder_lora, family, pp, dp, layers, galaxy):
    """Causal LM: the loss weighted by label tokens across replicas and micro-batches (dp 2: rows
    5 / 3). With targets in one stage's layers, the other stage trains nothing (galaxy's optimizer,
    empty)."""
    plan, shares = (Plan.preset("galaxy"), DECODERS[family][2]) if galaxy else (Plan(), ((8,), (96,), (TINY_SEQ,)))
    world = pp * dp * len(shares[0])
    # llama-pp2 without padding: the stages' attention applies the plain causal mask in its kernel
    batch_fn = tiny_lm_batch_unpadded if (family, pp, layers) == ("llama", 2, None) else tiny_lm_batch
    reports = dist_pool(world).run(lora_mesh_vs_peft, family, *decoder_lora(family, layers), plan, pp, dp,
                                   shares, batch_fn, 5, 0.1, 8, 2, "none", None, "sgd" if layers else None,
                                   (5, 3) if dp > 1 else None)
    for rank, report in enumerate(reports):
        check(report, rank)
    # Stage 0 (the first half of the ranks): with nothing trainable at or below it, no backward.
    assert [r["backward"] for r in reports] == [layers != "stage1"] * (world // 2) + [True] * (world // 2)


@pytest.fixture
def exported(request, dist_pool, decoder_lora, tiny_bert_dir, tmp_path):
    """export(family, merge) -> (model directory, export directory, galaxy's held-out logits,
    held-out batch): 2 LoRA steps under the Galaxy plan at world 2, exported by export_peft."""
    def export(family, merge):
        if family == "bert":
            model_dir, adapter = tiny_bert_dir, request.getfixturevalue("adapter_dir")
            shares, batch_fn, classes = UNEVEN_2, tiny_batch, ["a", "b", "c"]
        else:
            model_dir, adapter = decoder_lora(family)
            shares, batch_fn, classes = DECODERS[family][2], tiny_lm_batch, None
        out = str(tmp_path / family)
        logits = dist_pool(2).run(lora_train_and_export, model_dir, adapter, out, merge, Plan.preset("galaxy"),
                                  shares, batch_fn, classes)[0]
        return model_dir, out, logits, {k: v for k, v in batch_fn(seed=9).items() if k != "labels"}
    return export


@pytest.mark.parametrize("family,task", [("bert", "SEQ_CLS"), ("gpt2", "CAUSAL_LM")])
def test_export_loads_in_peft(exported, family, task):
    from peft import PeftModel
    model_dir, out, logits, batch = exported(family, False)
    config = json.loads(open(f"{out}/adapter_config.json").read())
    assert (config["peft_type"], config["task_type"], config["r"]) == ("LORA", task, 4)
    assert config["fan_in_fan_out"] == (family == "gpt2")       # GPT-2's projections are Conv1D
    ref = PeftModel.from_pretrained(HF_LOADERS[family](model_dir), out).eval()
    with torch.no_grad():
        assert rel_err(logits, ref(**batch).logits) < TOL


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_merged_export_is_a_plain_hf_checkpoint(exported, family):
    import os
    _, out, logits, batch = exported(family, True)
    assert not os.path.exists(f"{out}/adapter_config.json")
    ref = HF_LOADERS[family](out).eval()
    with torch.no_grad():
        assert rel_err(logits, ref(**batch).logits) < TOL


def serial_model(model_dir, **options):
    model = build_model(model_dir, Plan(), GalaxyGroup.serial(6, 96, TINY_SEQ), num_labels=3)
    return model, apply_peft(model, PeftOptions("lora", **options), seed=3)


def test_defaults_adapt_query_and_value_and_train_the_classifier(tiny_bert_dir):
    model, trainable = serial_model(tiny_bert_dir)
    lora = sorted({n.split(".")[3] for n in trainable if ".lora_" in n})
    assert lora == ["query", "value"]
    assert {n for n in trainable if ".lora_" not in n} == {"classifier.weight", "classifier.bias"}
    # B starts at zero: the model computes the base model's logits.
    base = build_model(tiny_bert_dir, Plan(), GalaxyGroup.serial(6, 96, TINY_SEQ), num_labels=3)
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
    # fan_in_fan_out is for projections stored [in, out] (GPT-2's Conv1D); BERT's are [out, in].
    (bad / "adapter_config.json").write_text(json.dumps({**config, "fan_in_fan_out": True}))
    with pytest.raises(ValueError, match="fan_in_fan_out = true"):
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



class ProjectionProducts(TorchDispatchMode):
    """Counts the matrix products of projections (mm, addmm, addmm_: the attention core's products
    are each kernel's own affair) and their FLOPs, 2 per multiply-add."""

    def __init__(self):
        super().__init__()
        self.calls = self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.addmm_.default):
            a, b = args[-2:]                                  # [m, k] @ [k, n]
            self.calls, self.flops = self.calls + 1, self.flops + 2 * a.shape[0] * a.shape[1] * b.shape[1]
        return func(*args, **(kwargs or {}))


def projection_products(model, loss_of, batch) -> tuple[int, int]:
    """(calls, FLOPs) of the projections' products in one forward with the loss and its backward."""
    with ProjectionProducts() as counted:
        loss_of(model(**batch)).backward()
    return counted.calls, counted.flops


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_serial_lora_step_multiplies_what_peft_does(tiny_bert_dir, adapter_dir, decoder_lora, family):
    """A LoRA step computes no gradient of a frozen weight (no weight-gradient product) and no
    product peft's step on Hugging Face's model does not: the same products, the same FLOPs."""
    from support.peft_runners import peft_reference
    if family == "bert":
        model_dir, adapter, group, batch = tiny_bert_dir, adapter_dir, GalaxyGroup.serial(6, 96, TINY_SEQ), tiny_batch(0)
    else:
        # unpadded, as the bench's batch: attention under the kernel's causal mask
        (model_dir, adapter), batch = decoder_lora("llama"), tiny_lm_batch(0, padded=False)
        group = GalaxyGroup.serial(*(sum(s) for s in DECODERS["llama"][2]))
    ours = build_model(model_dir, Plan(), group, num_labels=3 if family == "bert" else None)
    apply_peft(ours, PeftOptions("lora", lora_path=adapter))
    theirs = peft_reference(family, model_dir, adapter)
    products = projection_products(ours.train(), lambda out: out[1], batch)
    assert products == projection_products(theirs, lambda out: out.loss, batch)
    assert products[0] > 0
