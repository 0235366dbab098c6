"""BERT under every per-sub-block plan trains exactly like HF BertForSequenceClassification.

For all 8 combinations of ATT (TP|SP) x MLP (TP|SP) x CON (SP|None), world 2 and 3, even and
uneven shares: logits, loss and every gradient (gathered to full shape) after one step, then the
loss of each of 5 SGD steps and the gathered weights at the end, all within 1e-5 relative of
HF's serial model on the same weights and padded batches (fp32, dropout 0). At world 3 with uneven
shares an SP ATT attends in blocks of keys (kv_blocks), elsewhere once after the K/V gather.
"""
import itertools

import pytest

from support.parity import check_report
from support.parity_runners import train_plan_and_compare
from support.tiny_models import TINY_SEQ, tiny_batch

from galaxy.plan import Plan

COMBOS = list(itertools.product(("TP", "SP"), ("TP", "SP"), ("SP", "None")))
SHARES = {  # world -> {kind: (heads, intermediate, seq)}; tiny model: 6 heads, 96 columns, 12 tokens
    2: {"even": ((3, 3), (48, 48), (6, 6)), "uneven": ((4, 2), (64, 32), (7, 5))},
    3: {"even": ((2, 2, 2), (32, 32, 32), (4, 4, 4)), "uneven": ((3, 2, 1), (50, 30, 16), (6, 4, 2))},
}


@pytest.mark.parametrize("world,kind", [(2, "even"), (2, "uneven"), (3, "even"), (3, "uneven")])
@pytest.mark.parametrize("att,mlp,con", COMBOS, ids=[f"att{a}-mlp{m}-con{c}" for a, m, c in COMBOS])
def test_plan_matches_hf(dist_pool, tiny_bert_dir, world, kind, att, mlp, con):
    # World 3 uneven with an SP ATT: the own keys' block first, then the ranks' before and after.
    build = {"kv_blocks": True} if (world, kind, att) == (3, "uneven", "SP") else None
    if (world, kind) == (2, "uneven"):      # every transition's Link, 3 streams (2, 1, 1 rows) out of phase
        build = {"batch_streams": 3}
    reports = dist_pool(world).run(train_plan_and_compare, "bert", tiny_bert_dir, Plan(att, mlp, con),
                                   SHARES[world][kind], tiny_batch, 5, 0.5, build)
    for rank, report in enumerate(reports):
        check_report(report, rank)


def test_serial_matches_hf(dist_pool, tiny_bert_dir):
    report = dist_pool(1).run(train_plan_and_compare, "bert", tiny_bert_dir, Plan(),
                              ((6,), (96,), (TINY_SEQ,)), tiny_batch)[0]
    check_report(report, 0)


def dtensor_bench_errors(model_dir: str) -> dict:
    """bench/dtensor_bert's check of torch's own TP and TP+SP plans on one rank of the pool."""
    import sys
    from pathlib import Path

    import torch
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from dtensor_bert import NUM_LABELS, build_dtensor_bert, check_against_serial, load_bert
    batch = tiny_batch(0, num_labels=NUM_LABELS)
    f64 = torch.float64
    return {sp: check_against_serial(build_dtensor_bert(model_dir, sp, f64), load_bert(model_dir, f64), batch)
            for sp in (False, True)}


def test_bench_dtensor_tp_and_tpsp_train_like_hf(dist_pool, tmp_path):
    # The reference side of bench/dtensor_vs_galaxy.py: torch's TP+SP plan on HF BERT, whose
    # LayerNorm gradients DTensor must sum over the sequence shards (float64: the plan, not rounding)
    from support.tiny_models import make_tiny_bert
    model_dir = make_tiny_bert(str(tmp_path / "tiny4"), num_labels=4)
    for rank, errors in enumerate(dist_pool(2).run(dtensor_bench_errors, model_dir)):
        for sp, report in errors.items():
            worst = {k: v for k, v in report.items() if k != "tensors"}
            assert all(err < 1e-10 for err, _ in worst.values()), (rank, sp, worst)
            assert report["tensors"] == 41, report
