"""BERT under every per-sub-block plan trains exactly like HF BertForSequenceClassification.

For all 8 combinations of ATT (TP|SP) x MLP (TP|SP) x CON (SP|None), world 2 and 3, even and
uneven shares: logits, loss and every gradient (gathered to full shape) after one step, then the
loss of each of 5 SGD steps and the gathered weights at the end, all within 1e-5 relative of
HF's serial model on the same weights and padded batches (fp32, dropout 0).
"""
import itertools

import pytest
import torch

from parity import hf_bert, rel_err, worst_param_error, world_group
from tiny_models import TINY_SEQ, tiny_batch

from galaxy.models.build import build_model
from galaxy.parallel.full_state import gather_full
from galaxy.parallel.grad_sync import GradientSync
from galaxy.parallel.plan import ParallelPlan

TOL = 1e-5
COMBOS = list(itertools.product(("TP", "SP"), ("TP", "SP"), ("SP", "None")))
SHARES = {  # world -> {kind: (heads, intermediate, seq)}; tiny model: 6 heads, 96 columns, 12 tokens
    2: {"even": ((3, 3), (48, 48), (6, 6)), "uneven": ((4, 2), (64, 32), (7, 5))},
    3: {"even": ((2, 2, 2), (32, 32, 32), (4, 4, 4)), "uneven": ((3, 2, 1), (50, 30, 16), (6, 4, 2))},
}
STEPS, LR = 5, 0.5


def train_and_compare(model_dir, att, mlp, con, shares):
    torch.manual_seed(0)
    group = world_group(*shares)
    model = build_model(model_dir, ParallelPlan(att, mlp, con), group, num_labels=3)
    ref = hf_bert(model_dir)
    sync = GradientSync(model, group.pg)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    report = {"loss": []}
    for step in range(STEPS):
        batch = tiny_batch(seed=step)
        logits, loss = model(**batch)
        out = ref(**batch)
        loss.backward()
        out.loss.backward()
        sync()
        if step == 0:
            report["logits"] = rel_err(logits, out.logits)
            report["grad"] = worst_param_error(gather_full(model, grads=True), ref, grads=True)
        report["loss"].append(rel_err(loss, out.loss))
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    report["weights"] = worst_param_error(gather_full(model), ref, grads=False)
    return report


@pytest.mark.parametrize("world,kind", [(2, "even"), (2, "uneven"), (3, "even"), (3, "uneven")])
@pytest.mark.parametrize("att,mlp,con", COMBOS, ids=[f"att{a}-mlp{m}-con{c}" for a, m, c in COMBOS])
def test_plan_matches_hf(dist_pool, tiny_bert_dir, world, kind, att, mlp, con):
    for rank, r in enumerate(dist_pool(world).run(train_and_compare, tiny_bert_dir, att, mlp, con,
                                                  SHARES[world][kind])):
        assert r["logits"] < TOL, f"rank {rank}: logits off by {r['logits']}"
        assert max(r["loss"]) < TOL, f"rank {rank}: losses off by {r['loss']}"
        assert r["grad"][0] < TOL, f"rank {rank}: gradient of {r['grad'][1]} off by {r['grad'][0]}"
        assert r["weights"][0] < TOL, f"rank {rank}: weight {r['weights'][1]} off by {r['weights'][0]} after {STEPS} steps"


def test_serial_matches_hf_bitwise_scale(dist_pool, tiny_bert_dir):
    r = dist_pool(1).run(train_and_compare, tiny_bert_dir, "TP", "TP", "SP", ((6,), (96,), (TINY_SEQ,)))[0]
    assert r["logits"] < TOL and max(r["loss"]) < TOL and r["grad"][0] < TOL and r["weights"][0] < TOL, r
