"""The profiler's counts, serial: closed forms for BERT, Llama (grouped-query attention), Qwen2 and
GPT-2, the attention formula torch lacks on CPU, attribution per module, saved bytes, latency
nesting, JSON.

Every FLOP figure is compared exactly (integers), with 2 FLOPs per multiply-add.
"""
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from support.tiny_models import GPT2_INTERMEDIATE, TINY_BERT, TINY_GPT2, TINY_SEQ, make_tiny_gpt2, tiny_batch

from galaxy.distributed import collectives
from galaxy.distributed.group import GalaxyGroup
from galaxy.models.gpt2 import gpt2_matmul_flops
from galaxy.models.registry import FAMILIES
from galaxy.plan import Plan
from galaxy.profiler import CommRecorder, bert_matmul_flops, llama_matmul_flops, profile_model
from galaxy.profiler.formulas import Formulas
from galaxy.runtime.assemble import build_model

B = 4
TINY_LLAMA_GQA = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=48, max_position_embeddings=64,
                      attention_dropout=0.0, pad_token_id=0)


def bert_closed_form():
    t = TINY_BERT
    return bert_matmul_flops(batch=B, seq=TINY_SEQ, hidden=t["hidden_size"], layers=t["num_hidden_layers"],
                             intermediate=t["intermediate_size"], num_labels=t["num_labels"])


def llama_closed_form(seq):
    t = TINY_LLAMA_GQA
    return llama_matmul_flops(batch=B, seq=seq, hidden=t["hidden_size"], layers=t["num_hidden_layers"],
                              heads=t["num_attention_heads"], kv_heads=t["num_key_value_heads"],
                              intermediate=t["intermediate_size"], vocab=t["vocab_size"])


@pytest.fixture(scope="module")
def bert_report(tiny_bert_dir):
    t = TINY_BERT
    model = build_model(tiny_bert_dir, Plan(), GalaxyGroup.serial(t["num_attention_heads"],
                        t["intermediate_size"], TINY_SEQ), num_labels=t["num_labels"], dropout=0.0)
    return model, profile_model(model, tiny_batch(0, batch=B), repeats=0)


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("tiny_llama_gqa"))
    LlamaForCausalLM(LlamaConfig(**TINY_LLAMA_GQA)).save_pretrained(path)
    return path


def lm_batch(seq):
    ids = torch.randint(1, TINY_LLAMA_GQA["vocab_size"], (B, seq), generator=torch.Generator().manual_seed(0))
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)


def attention_counts(counter) -> int:
    return sum(v for op, v in counter.get_flop_counts().get("Global", {}).items() if "scaled_dot_product" in str(op))


@pytest.mark.parametrize("heads,kv_heads,causal", [(4, 4, False), (4, 2, False), (4, 2, True)])
def test_cpu_attention_formula(heads, kv_heads, causal):
    """torch 2.13 counts 0 for CPU scaled_dot_product_attention; the registered formula counts
    Q K^T and P V densely over the query heads, and 2x that for the backward."""
    b, s, d = 2, 6, 8
    q = torch.randn(b, heads, s, d, requires_grad=True)
    k, v = (torch.randn(b, kv_heads, s, d, requires_grad=True) for _ in range(2))
    dense = 2 * (2 * b * heads * s * s * d)
    with FlopCounterMode(display=False) as plain:
        F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    assert attention_counts(plain) in (0, dense)      # 0 on torch 2.13 (the reason for the formula)
    formulas = Formulas()
    with FlopCounterMode(display=False, custom_mapping=formulas.mapping) as counter:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        forward = attention_counts(counter)
        out.sum().backward()
    assert forward == dense
    assert attention_counts(counter) - forward == 2 * dense
    assert formulas.saw_causal == causal


def test_bert_matches_closed_form(bert_report):
    _, report = bert_report
    expected = bert_closed_form()
    t = report.totals
    assert t.fwd_flops == expected["total"]
    assert t.bwd_flops == 2 * expected["total"]        # dX and dW everywhere: embeddings need grads
    assert t.macs * 2 == t.fwd_flops
    assert t.elementwise_flops > 0 and t.bwd_elementwise_flops > 0


def test_bert_attribution_per_module_and_sub_block(bert_report):
    model, report = bert_report
    h, L = TINY_BERT["hidden_size"], TINY_BERT["num_hidden_layers"]
    parts = {k: v // L for k, v in bert_closed_form().items()}
    for i in range(L):
        for proj in ("query", "key", "value"):
            m = report.module(f"layers.{i}.att.{proj}")
            assert (m.fwd_flops, m.bwd_flops) == (2 * B * TINY_SEQ * h * h, 4 * B * TINY_SEQ * h * h)
    assert [(s.layer, s.name, s.kind) for s in report.sub_blocks] == [
        (i, n, k) for i in range(L) for n, k in (("att", "ATT"), ("con1", "CON"), ("mlp", "MLP"), ("con2", "CON"))]
    for s in report.sub_blocks:
        want = {"att": parts["qkv"] + parts["attention"] + parts["out"], "mlp": parts["mlp"]}.get(s.name, 0)
        assert (s.fwd_flops, s.bwd_flops, s.macs) == (want, 2 * want, want // 2), s
        assert s.fwd_elementwise_flops > 0 and s.act_bytes > 0
        assert s.params == sum(p.numel() for p in model.get_submodule(f"layers.{s.layer}.{s.name}").parameters())
    assert report.module("pooler").fwd_flops == bert_closed_form()["pooler"]
    assert report.totals.params == sum(p.numel() for p in model.parameters())


def test_llama_gqa_matches_closed_form_hf(tiny_llama_dir):
    """Interim check of the Llama closed form on Hugging Face's model (4 query heads, 2 K/V heads)."""
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(tiny_llama_dir, attn_implementation="sdpa")
    report = profile_model(model, lm_batch(16), repeats=0)
    assert report.totals.fwd_flops == llama_closed_form(16)["total"]
    assert report.totals.bwd_flops == 2 * llama_closed_form(16)["total"]
    assert any("causal attention is counted dense" in n for n in report.notes)


# Galaxy's own model, for each Llama-shaped family (Qwen2: q/k/v biases add no matrix product),
# against the family's closed form in the registry.
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_llama_gqa_matches_closed_form_galaxy(tiny_llama_dir, tmp_path, family):
    from transformers import AutoConfig, Qwen2Config, Qwen2ForCausalLM
    t, model_dir = TINY_LLAMA_GQA, tiny_llama_dir
    if family == "qwen2":
        model_dir = str(tmp_path)
        Qwen2ForCausalLM(Qwen2Config(**TINY_LLAMA_GQA)).save_pretrained(model_dir)
    model = build_model(model_dir, Plan(), GalaxyGroup.serial(
        t["num_attention_heads"], t["intermediate_size"], 16), dropout=0.0)
    report = profile_model(model, lm_batch(16), repeats=0)
    expected = FAMILIES[family].matmul_flops(AutoConfig.from_pretrained(model_dir), B, 16)
    assert expected == llama_closed_form(16)
    assert report.totals.fwd_flops == expected["total"]
    assert report.totals.bwd_flops == 2 * expected["total"]
    per_layer = {k: v // t["num_hidden_layers"] for k, v in expected.items()}
    att = [s for s in report.sub_blocks if s.kind == "ATT"]
    mlp = [s for s in report.sub_blocks if s.kind == "MLP"]
    assert {s.fwd_flops for s in att} == {per_layer["q"] + per_layer["kv"] + per_layer["attention"] + per_layer["o"]}
    assert {s.fwd_flops for s in mlp} == {per_layer["mlp"]}


def test_gpt2_matches_closed_form_galaxy(tmp_path):
    """Fused c_attn counts as Llama's q + kv (K/V heads = heads); the tied LM head scores every position."""
    t = TINY_GPT2
    model_dir = make_tiny_gpt2(str(tmp_path))
    model = build_model(model_dir, Plan(), GalaxyGroup.serial(t["n_head"], GPT2_INTERMEDIATE, 16), dropout=0.0)
    report = profile_model(model, lm_batch(16), repeats=0)
    expected = gpt2_matmul_flops(batch=B, seq=16, hidden=t["n_embd"], layers=t["n_layer"], heads=t["n_head"],
                                 intermediate=GPT2_INTERMEDIATE, vocab=t["vocab_size"])
    assert report.totals.fwd_flops == expected["total"]
    assert report.totals.bwd_flops == 2 * expected["total"]
    assert FAMILIES["gpt2"].matmul_flops(model.config, B, 16) == expected      # what profile_flops.py checks
    per_layer = {k: v // t["n_layer"] for k, v in expected.items()}
    assert {s.fwd_flops for s in report.sub_blocks if s.kind == "ATT"} == {
        per_layer["q"] + per_layer["kv"] + per_layer["attention"] + per_layer["o"]}
    assert {s.fwd_flops for s in report.sub_blocks if s.kind == "MLP"} == {per_layer["mlp"]}


class _ThreeOps(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.act, self.b = nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)

    def forward(self, x):
        return self.b(self.act(self.a(x))).sum()


@pytest.mark.parametrize("input_grad", [False, True])
def test_saved_bytes_and_first_layer_backward(input_grad):
    """Saved activations per module, once per storage, weights excluded; a linear layer whose
    input needs no gradient computes only dW (1x its forward), the others dX and dW (2x)."""
    x = torch.randn(5, 8, requires_grad=input_grad)
    report = profile_model(_ThreeOps(), dict(x=x), repeats=0)
    a, act, b = (report.module(n) for n in ("a", "act", "b"))
    assert (a.act_bytes, act.act_bytes, b.act_bytes) == (5 * 8 * 4, 5 * 16 * 4, 5 * 16 * 4)
    assert (a.fwd_flops, b.fwd_flops) == (2 * 5 * 8 * 16, 2 * 5 * 16 * 4)
    assert a.bwd_flops == (2 if input_grad else 1) * a.fwd_flops
    assert b.bwd_flops == 2 * b.fwd_flops
    assert act.fwd_elementwise_flops == 5 * 16 and act.fwd_flops == 0


def test_latency_nests(bert_report):
    model, _ = bert_report
    report = profile_model(model, tiny_batch(0, batch=B), repeats=1, warmup=0)
    by_name = {m.name: m for m in report.modules}
    for m in report.modules:
        kids = [k for k in report.modules if k.name.rpartition(".")[0] == m.name and k.name and k.called]
        if m.called and kids:
            assert m.fwd_latency_s >= sum(k.fwd_latency_s for k in kids) - 1e-9, m.name
    assert by_name["layers.0.att.query"].fwd_latency_s > 0
    assert all(s.fwd_latency_s > 0 and s.bwd_latency_s > 0 for s in report.sub_blocks)
    assert report.totals.bwd_latency_s >= by_name["layers"].bwd_latency_s


def test_json_schema(bert_report):
    _, report = bert_report
    doc = json.loads(report.to_json())
    totals = doc["totals"]
    for key in ("params", "fwd_flops", "bwd_flops", "macs", "elementwise_flops"):
        assert type(totals[key]) is int
    assert doc["modules"][0]["name"] == "" and {"name", "params", "fwd_flops", "bwd_flops", "macs",
                                                  "fwd_latency_s", "bwd_latency_s"} <= set(doc["modules"][0])
    assert {"layer", "name", "kind", "fwd_flops", "params", "act_bytes", "fwd_latency_s"} <= set(doc["sub_blocks"][0])
    assert doc["comm"]["total"] == {"calls": 0, "sent": 0, "received": 0}


def test_recorder_is_removed_and_not_nested(bert_report):
    assert collectives.comm_recorder is None
    with CommRecorder():
        with pytest.raises(RuntimeError):
            CommRecorder().__enter__()
    assert collectives.comm_recorder is None


def test_recomputed_layers_count_one_more_forward(tiny_bert_dir):
    """Activation checkpointing: each recomputed layer's forward runs again inside backward, so
    the backward counts 2x the whole forward plus 1x the recomputed layers' part."""
    t = TINY_BERT
    group = GalaxyGroup.serial(t["num_attention_heads"], t["intermediate_size"], TINY_SEQ)
    model = build_model(tiny_bert_dir, Plan(checkpoint=(1,)), group, num_labels=t["num_labels"], dropout=0.0)
    report = profile_model(model, tiny_batch(0, batch=B), repeats=0)
    expected = bert_closed_form()
    per_layer = sum(expected[k] for k in ("qkv", "attention", "out", "mlp")) // t["num_hidden_layers"]
    assert report.totals.fwd_flops == expected["total"]
    assert report.totals.bwd_flops == 2 * expected["total"] + per_layer


def test_memory_report_knows_recompute_and_dp_sharding(tiny_bert_dir):
    """Every layer recomputed: a layer keeps only its inputs ([B, S, h] fp32, plus the [B, 1, 1, S]
    bool mask the first one sees first), far below what it saves otherwise. dp_shards: weights,
    gradients and AdamW state per rank are the dim-0 halves (rounded up) of the whole model's."""
    from galaxy.profiler.profile import memory_of
    t = TINY_BERT
    group = GalaxyGroup.serial(t["num_attention_heads"], t["intermediate_size"], TINY_SEQ)
    reports = {}
    for spec in ("none", "full"):
        model = build_model(tiny_bert_dir, Plan(checkpoint=spec), group, num_labels=t["num_labels"], dropout=0.0)
        reports[spec] = profile_model(model, tiny_batch(0, batch=B), repeats=0, dp_shards=2)
    layer = {s: {m.name: m.act_bytes for m in r.modules} for s, r in reports.items()}
    inputs = B * TINY_SEQ * t["hidden_size"] * 4
    assert (layer["full"]["layers.0"], layer["full"]["layers.1"]) == (inputs + B * TINY_SEQ, inputs)
    assert layer["none"]["layers.1"] > 5 * inputs
    full = reports["full"].memory
    assert full["activations"] == reports["full"].totals.act_bytes < reports["none"].totals.act_bytes / 3
    whole = memory_of(model, 0)
    params = list(model.parameters())
    assert whole["weights"] == sum(p.numel() * 4 for p in params) and whole["optimizer"] == 2 * whole["grads"]
    halves = sum(-(-p.shape[0] // 2) * (p.numel() // p.shape[0]) * 4 for p in params)
    assert full["weights"] == full["grads"] == halves and full["optimizer"] == 2 * halves
    assert whole["weights"] / 2 <= halves < whole["weights"] / 2 + 4 * sum(p.numel() // p.shape[0] for p in params)
