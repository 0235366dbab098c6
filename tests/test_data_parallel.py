"""Data parallelism trains exactly like HF serial training on the global batch.

Every replica trains on its own rows only (batch 8 over dp 2: 4 rows each); DDP averages the
gradients. 5 SGD steps against the serial Hugging Face model within 1e-5 relative: step-0 logits,
each step's global-batch mean loss (the same on every rank), step-0 gradients and final weights
gathered over Galaxy shards. BERT at world 2, dp 2 x Galaxy 2 at world 4, and the causal LMs
(Llama, Qwen2: Llama with q/k/v biases, and GPT-2), whose replicas and micro-batches hold very
different numbers of label tokens (the loss is weighted by tokens, as HF's mean over the global
batch's tokens is). DDP's bucket bytes reach the recorder.
"""
import pytest
import torch
import torch.distributed as dist

from parity import check_report
from parity_runners import train_runner_and_compare
from tiny_models import GPT2_INTERMEDIATE, TINY_SEQ, tiny_batch, tiny_lm_batch

from galaxy.parallel.data_parallel import split_rows
from galaxy.parallel.plan import ParallelPlan

GALAXY = ParallelPlan.preset("galaxy")


def run_case(pool, family, model_dir, plan, dp, shares, batch_fn, **options):
    reports = pool.run(train_runner_and_compare, family, model_dir, plan, 1, dp, shares, batch_fn, options)
    for rank, report in enumerate(reports):
        check_report(report, rank)


def test_dp2_matches_hf(dist_pool, tiny_bert_dir):
    run_case(dist_pool(2), "bert", tiny_bert_dir, GALAXY, 2, ((6,), (96,), (TINY_SEQ,)), tiny_batch)


def test_dp2_x_galaxy2_matches_hf(dist_pool, tiny_bert_dir):
    """Replicas of an uneven Galaxy group: DDP over ranks {0, 2} and {1, 3}."""
    run_case(dist_pool(4), "bert", tiny_bert_dir, ParallelPlan("TP", "SP", "SP"), 2,
             ((4, 2), (64, 32), (7, 5)), tiny_batch)


SERIAL = {"llama": ((8,), (96,), (TINY_SEQ,)), "qwen2": ((8,), (96,), (TINY_SEQ,)),
          "gpt2": ((4,), (GPT2_INTERMEDIATE,), (TINY_SEQ,))}


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_causal_lm_dp2_with_accumulation_matches_hf(dist_pool, tiny_lm_dir, family):
    """Replica 0 holds rows of 12, 8, 4, 2 tokens, replica 1 rows of 2 tokens; 2 micro-batches each."""
    run_case(dist_pool(2), family, tiny_lm_dir(family), GALAXY, 2, SERIAL[family], tiny_lm_batch,
             grad_accum_steps=2)


def _ddp_bytes(model_dir):
    from galaxy.distributed.mesh import make_mesh
    from galaxy.runtime.runners import build_runner
    from galaxy.profiler.comm import CommRecorder, ring_bytes
    mesh = make_mesh(1, 2, (6,), (96,), (TINY_SEQ,))
    runner = build_runner(model_dir, GALAXY, mesh, num_labels=3)
    batch = {k: v[4 * dist.get_rank():][:4] for k, v in tiny_batch(seed=0, batch=8).items()}
    with CommRecorder() as rec:
        runner.step(batch)
    grads = sum(p.numel() for p in runner.parameters())
    return rec.stats.total().sent, ring_bytes("all_reduce", grads, 4, 2)


def test_ddp_buckets_are_recorded(dist_pool, tiny_bert_dir):
    for sent, expected in dist_pool(2).run(_ddp_bytes, tiny_bert_dir):
        # one all-reduce per bucket: per-bucket rounding of the ring's chunks only
        assert expected <= sent <= expected + 64


def test_split_rows():
    batch = {"input_ids": torch.arange(12).view(6, 2), "labels": torch.arange(6)}
    parts = split_rows(batch, 3)
    assert [p["labels"].tolist() for p in parts] == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError, match="6 rows per replica cannot be split into 4"):
        split_rows(batch, 4)
