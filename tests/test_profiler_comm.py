"""The profiler under parallel plans (world 2 and 3, uneven shares), against closed forms:

* the collectives each rank issues in one training step (forward, backward, gradient sync), by
  kind, in bytes sent and received, equal the closed form of the plan's transitions
  (galaxy.distributed.comm_bytes.plan_comm_bytes, ring convention of galaxy.profiler.comm);
* each rank's local matrix FLOPs of every sub-block sum over the ranks to the serial count, and the
  replicated head (pooler, classifier) costs every rank the serial amount.
"""
import itertools
from argparse import Namespace
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from support.tiny_models import TINY_BERT, TINY_SEQ, tiny_batch

from galaxy.distributed.group import GalaxyGroup
from galaxy.runtime.assemble import build_model
from galaxy.parallel.grad_sync import GradientSync
from galaxy.plan import Plan
from galaxy.profiler import bert_matmul_flops, bert_plan_comm_bytes, profile_model
from galaxy.profiler.comm import ring_bytes

B = 4
COMBOS = list(itertools.product(("TP", "SP"), ("TP", "SP"), ("SP", "None")))
SHARES = {2: ((4, 2), (64, 32), (7, 5)), 3: ((3, 2, 1), (50, 30, 16), (6, 4, 2))}


def profile_rank(model_dir, plan, shares):
    rank, world = dist.get_rank(), dist.get_world_size()
    group = GalaxyGroup(rank, world, dist.group.WORLD, *shares)
    model = build_model(model_dir, plan, group, num_labels=TINY_BERT["num_labels"], dropout=0.0)
    return profile_model(model, tiny_batch(0, batch=B), grad_sync=GradientSync(model, group.pg), repeats=0,
                         plan={"att": plan.att, "mlp": plan.mlp, "con": plan.con})


def serial_parts():
    t = TINY_BERT
    return bert_matmul_flops(batch=B, seq=TINY_SEQ, hidden=t["hidden_size"], layers=t["num_hidden_layers"],
                             intermediate=t["intermediate_size"], num_labels=t["num_labels"])


def check_plan(reports, plan, shares):
    t, world = TINY_BERT, len(reports)
    expected = bert_plan_comm_bytes(plan, seq_shares=shares[2], batch=B, hidden=t["hidden_size"],
                                    layers=t["num_hidden_layers"], intermediate=t["intermediate_size"])
    for r in reports:
        assert r.comm["by_kind"] == expected, f"rank {r.rank}"
    parts = serial_parts()
    L = t["num_hidden_layers"]
    per_layer = {"att": (parts["qkv"] + parts["attention"] + parts["out"]) // L, "mlp": parts["mlp"] // L,
                 "con1": 0, "con2": 0}
    for i, name in itertools.product(range(L), per_layer):
        fwd = [next(s.fwd_flops for s in r.sub_blocks if (s.layer, s.name) == (i, name)) for r in reports]
        bwd = [next(s.bwd_flops for s in r.sub_blocks if (s.layer, s.name) == (i, name)) for r in reports]
        assert (sum(fwd), sum(bwd)) == (per_layer[name], 2 * per_layer[name]), (i, name, fwd)
    head = parts["pooler"] + parts["classifier"]
    for r in reports:
        assert r.module("pooler").fwd_flops + r.module("classifier").fwd_flops == head
    assert sum(r.totals.fwd_flops for r in reports) == parts["total"] + (world - 1) * head
    assert sum(r.totals.bwd_flops for r in reports) == 2 * (parts["total"] + (world - 1) * head)


@pytest.mark.parametrize("att,mlp,con", COMBOS, ids=[f"att{a}-mlp{m}-con{c}" for a, m, c in COMBOS])
def test_world2_uneven(dist_pool, tiny_bert_dir, att, mlp, con):
    plan = Plan(att, mlp, con)
    check_plan(dist_pool(2).run(profile_rank, tiny_bert_dir, plan, SHARES[2]), plan, SHARES[2])


@pytest.mark.parametrize("preset", ["galaxy", "sp", "tp"])
def test_world3_uneven(dist_pool, tiny_bert_dir, preset):
    plan = Plan.preset(preset)
    check_plan(dist_pool(3).run(profile_rank, tiny_bert_dir, plan, SHARES[3]), plan, SHARES[3])


def test_galaxy_plan_by_hand(dist_pool, tiny_bert_dir):
    """The closed form written out for ATT TP / CON SP / MLP TP, world 2, tokens (7, 5): per layer and
    sub-block, an all-gather in and a reduce-scatter out (forward), the reverse in the backward;
    [b, 7, h] fp32 shards; the [CLS] gather; one all-reduce of the CON norms and deferred biases."""
    h, L = TINY_BERT["hidden_size"], TINY_BERT["num_hidden_layers"]
    shard = B * 7 * h * 4
    reports = dist_pool(2).run(profile_rank, tiny_bert_dir, Plan("TP", "TP", "SP"), SHARES[2])
    by_phase = reports[0].comm["by_phase"]
    assert by_phase["forward"]["all_gather"] == {"calls": 2 * L + 1, "sent": (2 * L) * shard + B * h * 4,
                                                 "received": (2 * L) * shard + B * h * 4}
    assert by_phase["forward"]["reduce_scatter"]["sent"] == 2 * L * shard
    assert by_phase["backward"]["all_gather"]["calls"] == 2 * L + 1          # + enter's split
    assert by_phase["grad_sync"]["all_reduce"] == {"calls": 1, "sent": 2 * (6 * h * L // 2) * 4,
                                                   "received": 2 * (6 * h * L // 2) * 4}
    assert ring_bytes("all_reduce", 6 * h * L, 4, 2) == by_phase["grad_sync"]["all_reduce"]["sent"]


def test_rank0_report_text(dist_pool, tiny_bert_dir):
    """What profile_flops.py prints on rank 0 under a plan: every rank's FLOPs and bytes, and the
    comparison with the closed form."""
    from galaxy.profiler.cli import ProfileJob, render
    plan = Plan("TP", "TP", "SP")
    reports = dist_pool(2).run(profile_rank, tiny_bert_dir, plan, SHARES[2])
    t = TINY_BERT
    expected = bert_plan_comm_bytes(plan, seq_shares=SHARES[2][2], batch=B, hidden=t["hidden_size"],
                                    layers=t["num_hidden_layers"], intermediate=t["intermediate_size"])
    from galaxy.models.build import load_hf_config
    job = ProfileJob(SimpleNamespace(batch_size=B, pad_size=TINY_SEQ, plan=plan), Namespace(model="bert"), {},
                     load_hf_config(tiny_bert_dir), t["num_labels"])
    text = render(reports, job, 1, expected)
    assert "matches every rank" in text
    assert "plan ATT TP / CON SP / MLP TP" in text
    assert "reduce_scatter" in text and "\n1     " in text   # rank 1's row
