"""Llama's and GPT-2's communication under parallel plans, measured by the profiler, against their
closed forms.

The CommRecorder counts the collectives each rank really issues in one training step (forward,
backward, gradient sync); galaxy.models.llama.llama_plan_comm_bytes derives them from the
shapes and the plan alone. They must agree byte for byte, per collective kind, on every rank:
all 8 ATT x MLP x CON plans at world 2 with uneven shares, the galaxy / tp / sp presets at world 3,
tied embeddings, attention and MLP biases. Two plans are also written out by hand, per phase.
Qwen2 (q/k/v biases without an o_proj bias: a "sum" count no Llama config has) under three plans
at world 2, against its registry entry's closed form, read from the checkpoint's config.

The tiny Llama has hidden size 48, grouped-query attention, 12 query heads sharing 4 K/V heads
(3 per group), and head_dim 10 (not hidden / heads = 4): the K/V width SP attention gathers,
2 x 4 x 10 = 80, differs from the hidden size, the query width (12 x 10 = 120), 2 x hidden (96)
and the ungrouped 2 x 12 x 10 = 240, so a closed form that used any of those would fail.

The tiny GPT-2 (4 heads of 12, hidden 48, LayerNorms with biases, fused c_attn, tied LM head) under
four plans at world 2, heads 3 / 1: galaxy.models.gpt2.gpt2_plan_comm_bytes.
"""
import itertools
import json

import pytest
import torch.distributed as dist

from support.tiny_models import GPT2_INTERMEDIATE, TINY_GPT2, TINY_LLAMA, TINY_SEQ, make_tiny_llama, tiny_lm_batch

from galaxy.distributed.group import GalaxyGroup
from galaxy.models.build import load_hf_config
from galaxy.models.gpt2 import gpt2_plan_comm_bytes
from galaxy.models.registry import family_of
from galaxy.runtime.assemble import build_model
from galaxy.parallel.grad_sync import GradientSync
from galaxy.plan import Plan
from galaxy.profiler import llama_plan_comm_bytes, profile_model

B = 3
GQA = dict(hidden_size=48, num_attention_heads=12, num_key_value_heads=4, head_dim=10)
T = {**TINY_LLAMA, **GQA}     # the tested model's config
COMBOS = list(itertools.product(("TP", "SP"), ("TP", "SP"), ("SP", "None")))
# (query heads, MLP columns, tokens) per rank; TP head shares are whole K/V groups (3 query heads each).
SHARES = {2: ((9, 3), (64, 32), (7, 5)), 3: ((6, 3, 3), (50, 30, 16), (6, 4, 2))}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_llama(str(tmp_path_factory.mktemp("llama_comm")), **GQA)


def profile_rank(model_dir, plan, shares):
    rank, world = dist.get_rank(), dist.get_world_size()
    group = GalaxyGroup(rank, world, dist.group.WORLD, *shares)
    model = build_model(model_dir, plan, group, dropout=0.0)
    return profile_model(model, tiny_lm_batch(0, batch=B), grad_sync=GradientSync(model, group.pg), repeats=0,
                         plan={"att": plan.att, "mlp": plan.mlp, "con": plan.con})


def closed_form(plan, shares, **cfg):
    t = {**T, **cfg}
    return llama_plan_comm_bytes(plan, seq_shares=shares[2], batch=B, hidden=t["hidden_size"],
                                 layers=t["num_hidden_layers"], heads=t["num_attention_heads"],
                                 kv_heads=t["num_key_value_heads"], intermediate=t["intermediate_size"],
                                 vocab=t["vocab_size"], head_dim=t["head_dim"],
                                 attention_bias=t.get("attention_bias", False), mlp_bias=t.get("mlp_bias", False))


def check(dist_pool, model_dir, plan, world, **cfg):
    reports = dist_pool(world).run(profile_rank, model_dir, plan, SHARES[world])
    expected = closed_form(plan, SHARES[world], **cfg)
    assert expected, "a plan over several ranks communicates"
    for r in reports:
        assert r.comm["by_kind"] == expected, f"rank {r.rank}"
    return reports


@pytest.mark.parametrize("att,mlp,con", COMBOS, ids=[f"att{a}-mlp{m}-con{c}" for a, m, c in COMBOS])
def test_world2_uneven(dist_pool, llama_dir, att, mlp, con):
    check(dist_pool, llama_dir, Plan(att, mlp, con), 2)


@pytest.mark.parametrize("preset", ["galaxy", "sp", "tp"])
def test_world3_uneven(dist_pool, llama_dir, preset):
    check(dist_pool, llama_dir, Plan.preset(preset), 3)


@pytest.mark.parametrize("plan", [Plan("TP", "TP", "SP"), Plan("SP", "TP", "None")],
                         ids=["galaxy", "attSP-mlpTP-conNone"])
def test_tied_embeddings(dist_pool, tmp_path_factory, plan):
    """A tied head all-reduces its own gradient contribution, [vocab, H], as an untied one does."""
    tied = make_tiny_llama(str(tmp_path_factory.mktemp("llama_tied")), **GQA, tie_word_embeddings=True)
    check(dist_pool, tied, plan, 2)


@pytest.mark.parametrize("plan", [Plan("SP", "SP", "SP"), Plan("SP", "SP", "None")],
                         ids=["sp", "attSP-mlpSP-conNone"])
def test_biases(dist_pool, tmp_path_factory, plan):
    """q/k/v and gate/up biases are summed under SP; the deferred o/down biases follow CON's rule."""
    cfg = dict(attention_bias=True, mlp_bias=True)
    path = make_tiny_llama(str(tmp_path_factory.mktemp("llama_bias")), **GQA, **cfg)
    check(dist_pool, path, plan, 2, **cfg)


@pytest.mark.parametrize("plan", [Plan("SP", "SP", "SP"), Plan("SP", "TP", "None"),
                                  Plan("TP", "SP", "SP")],
                         ids=["sp", "attSP-mlpTP-conNone", "attTP-mlpSP-conSP"])
def test_qwen2(dist_pool, tiny_lm_dir, plan):
    """Every kind against the spec's closed form; the gradient sync also by hand: the RMSNorm
    weights under CON SP (no o_proj bias), under ATT SP the q/k/v weights and biases
    (q_proj [120, H] + [120], k_proj and v_proj [40, H] + [40], o_proj [H, 120]), under MLP SP
    gate, up and down."""
    H, L, I = T["hidden_size"], T["num_hidden_layers"], T["intermediate_size"]
    path = tiny_lm_dir("qwen2", **GQA)
    expected = family_of("qwen2").plan_comm_bytes(plan, load_hf_config(path), B, SHARES[2][2])
    summed = (2 * L + 1) * H * (plan.con == "SP") + L * (2 * 120 * H + 2 * 40 * H + 120 + 2 * 40) * (plan.att == "SP") \
        + L * 3 * H * I * (plan.mlp == "SP")
    for r in dist_pool(2).run(profile_rank, path, plan, SHARES[2]):
        assert r.comm["by_kind"] == expected, f"rank {r.rank}"
        assert r.comm["by_phase"]["grad_sync"]["all_reduce"]["sent"] == 2 * -(-summed // 2) * 4


def test_galaxy_plan_by_hand(dist_pool, llama_dir):
    """ATT TP / CON SP / MLP TP, world 2, tokens (7, 5), written out per phase. Shards are
    [b, 7, H] fp32. Forward: per layer and TP sub-block a gather in and a reduce-scatter out, then
    the loss (1 element: the ring all-reduce moves 2 (N-1) ceil(1/N) = 2 elements each way). Backward: the
    reverse per sub-block, the entry split's gather, the LM head gradient [V, H]. Sync: the
    (2L + 1) RMSNorm weights [H]."""
    H, L, V = T["hidden_size"], T["num_hidden_layers"], T["vocab_size"]
    shard = B * 7 * H * 4
    reports = dist_pool(2).run(profile_rank, llama_dir, Plan("TP", "TP", "SP"), SHARES[2])
    for r in reports:
        ph = r.comm["by_phase"]
        assert ph["forward"]["all_gather"] == {"calls": 2 * L, "sent": 2 * L * shard, "received": 2 * L * shard}
        assert ph["forward"]["reduce_scatter"] == {"calls": 2 * L, "sent": 2 * L * shard, "received": 2 * L * shard}
        assert ph["forward"]["all_reduce"] == {"calls": 1, "sent": 2 * 4, "received": 2 * 4}
        assert ph["backward"]["all_gather"] == {"calls": 2 * L + 1, "sent": (2 * L + 1) * shard,
                                                "received": (2 * L + 1) * shard}
        assert ph["backward"]["reduce_scatter"]["sent"] == 2 * L * shard
        assert ph["backward"]["all_reduce"] == {"calls": 1, "sent": V * H * 4, "received": V * H * 4}
        assert ph["grad_sync"] == {"all_reduce": {"calls": 1, "sent": (2 * L + 1) * H * 4,
                                                  "received": (2 * L + 1) * H * 4}}


def test_sp_plan_by_hand(dist_pool, llama_dir):
    """ATT SP / CON SP / MLP SP, world 3, tokens (6, 4, 2): no transitions inside a layer; per layer
    one gather of rotated K and V, [b, 6, 2 x 4 K/V heads x 10] padded to the longest share, each of
    the other 2 ranks' shards received once, and the reduce-scatter of its gradient. Sync: every
    weight but the embeddings and head, 2 (N-1) ceil(E/N) elements."""
    H, L, I = T["hidden_size"], T["num_hidden_layers"], T["intermediate_size"]
    kv = B * 6 * (2 * 4 * 10) * 4 * 2                # bytes: fp32 shard x (N - 1)
    # norms; q_proj [120, H] and o_proj [H, 120]; k_proj and v_proj [40, H]; gate, up, down
    summed = (2 * L + 1) * H + L * (2 * 120 * H + 2 * 40 * H + 3 * H * I)
    reports = dist_pool(3).run(profile_rank, llama_dir, Plan("SP", "SP", "SP"), SHARES[3])
    for r in reports:
        ph = r.comm["by_phase"]
        assert ph["forward"]["all_gather"] == {"calls": L, "sent": L * kv, "received": L * kv}
        assert ph["backward"]["reduce_scatter"] == {"calls": L, "sent": L * kv, "received": L * kv}
        assert ph["backward"]["all_gather"]["sent"] == B * 6 * H * 4 * 2     # entry split's backward
        assert ph["grad_sync"]["all_reduce"]["sent"] == 2 * 2 * -(-summed // 3) * 4


def test_profile_flops_check_line(dist_pool, llama_dir, tmp_path):
    """profile_flops.py's closed form for --model llama, built from the checkpoint's config.json as
    the script does, matches the measurement and says so in the report."""
    from argparse import Namespace
    from dataclasses import replace

    from galaxy.config import load_config
    from galaxy.profiler.cli import closed_form_comm, prepare, render
    plan = Plan("TP", "TP", "SP")
    config = tmp_path / "profile.json"
    config.write_text(json.dumps(dict(model_path=llama_dir, pad_size=TINY_SEQ, batch_size=B,
                                      att_parallel_method="TP", mlp_parallel_method="TP", con_parallel_method="SP")))
    job = prepare(load_config(str(config)), Namespace(model="llama", compare_deepspeed=False, repeats=1, warmup=0,
                                                      depth=1))
    expected = closed_form_comm(job, replace(plan, tokens=tuple(SHARES[2][2])))
    assert expected == closed_form(plan, SHARES[2])
    reports = dist_pool(2).run(profile_rank, llama_dir, plan, SHARES[2])
    text = render(reports, job, 1, expected)
    assert "matches every rank" in text and "DIFFERS" not in text


@pytest.fixture(scope="module")
def gpt2_dir(tiny_lm_dir):
    return tiny_lm_dir("gpt2")


@pytest.mark.parametrize("plan", [Plan("TP", "TP", "SP"), Plan("SP", "SP", "SP"),
                                  Plan("TP", "TP", "None"), Plan("SP", "TP", "None")],
                         ids=["galaxy", "sp", "tp", "attSP-mlpTP-conNone"])
def test_gpt2_world2_uneven(dist_pool, gpt2_dir, plan):
    """SP attention gathers K and V, [b, s, 2 x 48]; the sum rule covers LayerNorm biases too."""
    shares = ((3, 1), (120, 72), (7, 5))
    expected = gpt2_plan_comm_bytes(plan, seq_shares=shares[2], batch=B, hidden=TINY_GPT2["n_embd"],
                                    layers=TINY_GPT2["n_layer"], intermediate=GPT2_INTERMEDIATE,
                                    vocab=TINY_GPT2["vocab_size"])
    assert expected
    for r in dist_pool(2).run(profile_rank, gpt2_dir, plan, shares):
        assert r.comm["by_kind"] == expected, f"rank {r.rank}"

