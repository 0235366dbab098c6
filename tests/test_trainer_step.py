"""One optimizer step: global-norm clipping, gradient accumulation, bf16 autocast, step tokens.

Clipping under a sharded plan must equal torch's clip_grad_norm_ on HF's serial model (the norm
counts every sharded parameter once); accumulation must reproduce the full-batch losses; bf16
must run under TP/SP collectives and stay close to fp32.
"""
import pytest
import torch

from support.parity import hf_bert, worst_param_error, world_group
from support.tiny_models import tiny_batch
from support.trainer_support import GALAXY_W2, make_workspace, step_losses, train_on_rank, write_config

from galaxy.runtime.assemble import build_model
from galaxy.parallel.full_state import gather_full
from galaxy.parallel.grad_sync import GradientSync
from galaxy.plan import Plan
from galaxy.parallel.clip import clip_grad_norm_

MAX_NORM = 0.05   # well below the tiny model's gradient norm, so clipping really scales


def clip_vs_hf(model_dir, plan, shares):
    group = world_group(*shares)
    model = build_model(model_dir, plan, group, num_labels=3)
    ref = hf_bert(model_dir)
    batch = tiny_batch(seed=0)
    model(**batch)[1].backward()
    ref(**batch).loss.backward()
    GradientSync(model, group.pg)()
    norm = clip_grad_norm_(model, MAX_NORM)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
    return norm.item(), ref_norm.item(), worst_param_error(gather_full(model, grads=True), ref, grads=True)


@pytest.mark.parametrize("world,plan,shares", [
    (2, Plan("TP", "TP", "SP"), ((4, 2), (64, 32), (7, 5))),
    (3, Plan("SP", "TP", "None"), ((3, 2, 1), (50, 30, 16), (6, 4, 2))),
], ids=["galaxy-w2", "attSP-mlpTP-conNone-w3"])
def test_clip_matches_torch_on_the_serial_model(dist_pool, tiny_bert_dir, world, plan, shares):
    for rank, (norm, ref_norm, (err, where)) in enumerate(dist_pool(world).run(clip_vs_hf, tiny_bert_dir, plan, shares)):
        assert norm > 2 * MAX_NORM, "the test must clip"
        assert abs(norm - ref_norm) <= 1e-5 * ref_norm, (rank, norm, ref_norm)
        assert err < 1e-5, f"rank {rank}: clipped gradient of {where} off by {err}"


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("step"), n_train=32)


def test_grad_accumulation_reproduces_full_batch_losses(dist_pool, ws):
    pool = dist_pool(2)
    runs = {}
    for accum in (1, 4):
        name = f"accum{accum}"
        pool.run(train_on_rank, write_config(ws, name, max_steps=4, grad_accum_steps=accum, **GALAXY_W2))
        runs[accum] = step_losses(f"{ws['root']}/{name}/metrics.jsonl")
    assert list(runs[4]) == [1, 2, 3, 4]
    for step, loss in runs[1].items():
        assert abs(runs[4][step] - loss) <= 1e-5 * loss, (step, runs[4][step], loss)


def test_bf16_autocast_trains_under_galaxy(dist_pool, ws):
    pool = dist_pool(2)
    losses = {}
    for precision in ("none", "bf16"):
        name = f"precision_{precision}"
        # batch_streams 2: the config key through the trainer, and autocast across the streams' turns
        summary = pool.run(train_on_rank, write_config(ws, name, max_steps=3, mixed_precision=precision,
                                                       batch_streams=2, **GALAXY_W2))[0][0]
        losses[precision] = step_losses(f"{ws['root']}/{name}/metrics.jsonl")
        assert 0 <= summary["dev_accuracy"] <= 1
    diffs = [abs(losses["bf16"][k] - losses["none"][k]) for k in (1, 2, 3)]
    assert max(diffs) > 0, "bf16 gave fp32's losses bit for bit: autocast did not run"
    assert max(diffs) < 0.05, diffs


def test_step_tokens_ride_with_the_loss(dist_pool, ws):
    """dp 2 sums its replicas' token counts inside the loss's own all-reduce, and a pipeline's loss
    broadcast carries them to the first stage: both log the tokens per step of one Galaxy group
    that reads every row (same data order, different padding per row)."""
    from galaxy.train.metrics import read_metrics
    pool = dist_pool(2)
    tokens, losses = {}, {}
    galaxy = {**GALAXY_W2, "seq_scatter_list": [36, 28]}
    for preset, keys in (("galaxy", galaxy), ("dp", {"dp_deg": 2}), ("pp", {"pp_deg": 2, "num_microbatches": 2})):
        name = f"tokens_{preset}"
        pool.run(train_on_rank, write_config(ws, name, max_steps=3, shuffle=False, pad_size=64, **keys), preset)
        records = [r for r in read_metrics(f"{ws['root']}/{name}/metrics.jsonl") if "event" not in r]
        tokens[preset] = [r["tokens"] for r in records]
        losses[preset] = [r["loss"] for r in records]
    assert len(set(tokens["galaxy"])) > 1 and max(tokens["galaxy"]) < 8 * 64, "padding must vary"
    assert tokens["dp"] == tokens["galaxy"] == tokens["pp"], tokens
    for preset in ("dp", "pp"):
        assert all(abs(a - b) <= 1e-5 * b for a, b in zip(losses[preset], losses["galaxy"])), losses
