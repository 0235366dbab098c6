"""Resuming from a checkpoint continues the run: same plan exactly, other plans and worlds closely.

Each case trains 6 steps saving at step 3 (AdamW, linear schedule with warm-up, clipping,
2 micro-batches, shuffled data, an epoch boundary after step 5: every piece of state matters),
then resumes from step 3 and compares the losses of steps 4..6 with the uninterrupted run's.
"""
import os

import pytest
import torch

from support.trainer_support import GALAXY_W2, make_workspace, probe_optimizer_state, step_losses, train_on_rank, write_config

from galaxy.models.build import CheckpointError
from galaxy.train.checkpoint import latest_checkpoint, step_dir_name

EXACT = dict(num_epochs=2, max_steps=6, save_interval=3, lr_schedule="linear", warmup_steps=2, clip_grad=1.0,
             grad_accum_steps=2)
SP_W3 = dict(att_parallel_method="SP", con_parallel_method="SP", mlp_parallel_method="SP",
             seq_scatter_list=[7, 5, 4])


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("resume"), n_train=40)


def run(pool, ws, name, **keys):
    pool.run(train_on_rank, write_config(ws, name, **keys))
    return step_losses(os.path.join(ws["root"], name, "metrics.jsonl"))


def checkpoint(ws, name, step=3):
    return os.path.join(ws["root"], name, "ck", step_dir_name(step))


def uninterrupted(pool, ws, name, **keys):
    return run(pool, ws, name, save_dir=os.path.join(ws["root"], name, "ck"), **EXACT, **keys)


def max_diff(a, b, steps=(4, 5, 6)):
    assert all(k in b for k in steps), sorted(b)
    return max(abs(a[k] - b[k]) for k in steps)


@pytest.mark.parametrize("world,plan,dropout", [(1, {}, 0.0), (2, GALAXY_W2, 0.0), (2, GALAXY_W2, 0.1)],
                         ids=["serial", "galaxy-w2", "galaxy-w2-dropout"])
def test_resume_is_exact_under_the_same_plan(dist_pool, ws, world, plan, dropout):
    pool = dist_pool(world)
    tag = f"same-w{world}-d{dropout}"
    full = uninterrupted(pool, ws, f"{tag}-full", dropout=dropout, **plan)
    resumed = run(pool, ws, f"{tag}-resumed", resume=checkpoint(ws, f"{tag}-full"), dropout=dropout,
                  **{**EXACT, "save_interval": None}, **plan)
    assert sorted(resumed) == [4, 5, 6]
    assert max_diff(full, resumed) <= 1e-6      # with dropout too: the random streams are restored


def test_galaxy_w2_checkpoint_resumes_serial_and_sp_w3(dist_pool, ws):
    full = uninterrupted(dist_pool(2), ws, "cross-full", **GALAXY_W2)
    for world, plan in ((1, {}), (3, SP_W3)):
        name = f"cross-to-w{world}"
        config = write_config(ws, name, resume=checkpoint(ws, "cross-full"), **{**EXACT, "save_interval": None},
                              **plan)
        saved, regathered = dist_pool(world).run(train_on_rank, config, "galaxy", probe_optimizer_state)[0][1]
        assert saved.keys() == regathered.keys()
        assert all(torch.equal(saved[k], regathered[k]) for k in saved), "optimizer state changed in transit"
        resumed = step_losses(os.path.join(ws["root"], name, "metrics.jsonl"))
        # Other reduction orders: equal to rounding, not bit for bit.
        assert max_diff(full, resumed) <= 1e-5, (world, full, resumed)


SHARDED_DP2 = dict(dp_deg=2, dp_sharding="full")


def test_sharded_dp2_checkpoints_resume_serial_and_back_and_export(dist_pool, ws):
    """Sharded replicas (FSDP2, dp 2) write the full-shape checkpoint a serial run writes: it resumes
    serially, a serial checkpoint resumes into sharded replicas (no_reshard), the optimizer state
    survives each trip bit for bit, and the export loads in Hugging Face as the final weights."""
    from safetensors.torch import load_file
    from transformers import BertForSequenceClassification
    export = os.path.join(ws["root"], "fsdp-full", "hf")
    sharded = uninterrupted(dist_pool(2), ws, "fsdp-full", export_dir=export, **SHARDED_DP2)
    serial = uninterrupted(dist_pool(1), ws, "fsdp-serial")
    assert max_diff(sharded, serial, range(1, 7)) <= 1e-5          # the same training, to rounding
    for source, world, keys, full in (("fsdp-full", 1, {}, sharded),
                                      ("fsdp-serial", 2, dict(dp_deg=2, dp_sharding="no_reshard"), serial)):
        name = f"{source}-to-w{world}"
        config = write_config(ws, name, resume=checkpoint(ws, source), **{**EXACT, "save_interval": None}, **keys)
        saved, regathered = dist_pool(world).run(train_on_rank, config, "galaxy", probe_optimizer_state)[0][1]
        assert saved.keys() == regathered.keys()
        assert all(torch.equal(saved[k], regathered[k]) for k in saved), f"{name}: optimizer state changed"
        resumed = step_losses(os.path.join(ws["root"], name, "metrics.jsonl"))
        assert max_diff(full, resumed) <= 1e-5, (name, full, resumed)
    final = load_file(os.path.join(checkpoint(ws, "fsdp-full", 6), "model", "model.safetensors"))
    exported = BertForSequenceClassification.from_pretrained(export).state_dict()
    assert all(torch.equal(exported[k], t) for k, t in final.items() if k in exported)
    assert {k for k in exported if "position_ids" not in k} <= final.keys()


def test_serial_sgd_checkpoint_resumes_into_sharded_replicas(dist_pool, ws):
    """A serial run's SGD steps are fused; FSDP's DTensors have no fused SGD step (issue 33). The
    resumed optimizer keeps the step chosen for its own parameters, not the checkpoint's."""
    serial = uninterrupted(dist_pool(1), ws, "sgd-serial", optimizer="sgd", learning_rate=0.1)
    config = write_config(ws, "sgd-serial-to-fsdp", resume=checkpoint(ws, "sgd-serial"), optimizer="sgd",
                          learning_rate=0.1, **{**EXACT, "save_interval": None}, **SHARDED_DP2)
    dist_pool(2).run(train_on_rank, config)
    resumed = step_losses(os.path.join(ws["root"], "sgd-serial-to-fsdp", "metrics.jsonl"))
    assert max_diff(serial, resumed) <= 1e-5, (serial, resumed)


def test_latest_names_the_newest_checkpoint_and_old_ones_are_pruned(dist_pool, ws):
    save_dir = os.path.join(ws["root"], "keep", "ck")
    run(dist_pool(1), ws, "keep", num_epochs=2, max_steps=6, save_dir=save_dir, save_interval=2, keep_checkpoints=2)
    assert sorted(os.listdir(save_dir)) == ["latest", step_dir_name(4), step_dir_name(6)]
    assert latest_checkpoint(save_dir).step == 6


def test_resume_latest_without_a_checkpoint_starts_afresh(dist_pool, ws):
    losses = run(dist_pool(1), ws, "fresh", max_steps=2, save_dir=os.path.join(ws["root"], "fresh", "ck"),
                 resume="latest")
    assert sorted(losses) == [1, 2]


def test_a_changed_batch_size_is_refused_before_training(dist_pool, ws):
    from galaxy.config import apply_preset, load_config
    from galaxy.train.trainer import prepare_classifier
    save_dir = os.path.join(ws["root"], "bs8", "ck")
    run(dist_pool(1), ws, "bs8", max_steps=1, save_dir=save_dir)
    cfg = apply_preset(load_config(write_config(ws, "bigger", batch_size=16, save_dir=save_dir,
                                                resume="latest")), "galaxy")
    with pytest.raises(CheckpointError, match="batch_size 8"):
        prepare_classifier(cfg)
