"""Chunked, overlapped ATT and MLP collectives (comm_chunks > 1) train like comm_chunks 1, and Hugging Face.

World 2, tiny BERT, uneven token shares (7, 5): under the galaxy plan (CON SP: chunked all-gather
in, reduce-scatter out) and the tp plan (CON None: chunked all-reduces), with activation
checkpointing in one case, a model with comm_chunks 3 matches one with comm_chunks 1 in loss,
logits and every gradient over two SGD steps (the second step also runs the gradient sync's early
starts; a gradient that is zero in exact arithmetic, the key bias's, is compared against the
model's largest, as in parity.worst_param_error), and matches HF's serial model; the collectives it
issues are the closed form's with the ATT's and MLP's transitions in 3 chunks (3 x the calls, each
chunk padded to its longest part). BERT's padding mask checks that the attention core sees the
chunks' keys in sequence order (the decoders' causal masks and rotary positions: test_parity_llama).
"""
from dataclasses import replace

import pytest
import torch

from support.parity import hf_bert, rel_err, world_group, worst_param_error
from support.tiny_models import TINY_BERT, tiny_batch

from galaxy.parallel.full_state import gather_full
from galaxy.parallel.grad_sync import GradientSync
from galaxy.plan import Plan
from galaxy.profiler import bert_plan_comm_bytes
from galaxy.profiler.comm import CommRecorder
from galaxy.runtime.assemble import build_model

SHARES = ((4, 2), (64, 32), (7, 5))
B = 4


def chunked_vs_whole(model_dir, plan, checkpointing):
    group = world_group(*SHARES)
    plan = replace(plan, checkpoint=checkpointing)
    whole, chunked = (build_model(model_dir, p, group, num_labels=3, dropout=0.0)
                      for p in (plan, replace(plan, comm_chunks=3)))
    ref = hf_bert(model_dir)
    with torch.no_grad():
        ref.classifier.weight.copy_(whole.classifier.weight)
        ref.classifier.bias.copy_(whole.classifier.bias)
    syncs = [GradientSync(m, group.pg) for m in (whole, chunked)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (whole, chunked, ref)]
    worst = {"loss": 0.0, "logits": 0.0, "grad": 0.0, "hf_loss": 0.0, "hf_grad": 0.0}
    comm = None
    for step in range(2):
        batch = tiny_batch(seed=step, batch=B)
        (lw, w_loss), = [whole(**batch)]
        w_loss.backward()
        syncs[0]()
        with CommRecorder() as rec:
            lc, c_loss = chunked(**batch)
            c_loss.backward()
            syncs[1]()
        comm = comm or rec.stats.to_dict()["by_kind"]
        out = ref(**batch)
        out.loss.backward()
        worst["loss"] = max(worst["loss"], rel_err(c_loss, w_loss))
        worst["logits"] = max(worst["logits"], rel_err(lc, lw))
        worst["hf_loss"] = max(worst["hf_loss"], rel_err(c_loss, out.loss))
        pairs = [(a.grad, b.grad) for a, b in zip(chunked.parameters(), whole.parameters())]
        floor = 1e-3 * max(b.abs().max().item() for _, b in pairs)    # zero-valued gradients: noise
        worst["grad"] = max(worst["grad"], max(((a - b).abs().max() / max(b.abs().max().item(), floor)).item()
                                               for a, b in pairs))
        worst["hf_grad"] = max(worst["hf_grad"], worst_param_error(gather_full(chunked, grads=True), ref, grads=True)[0])
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return worst, comm


@pytest.mark.parametrize("preset,checkpointing", [("galaxy", "full"), ("tp", "none")])
def test_chunked_att_and_mlp_match_whole_and_hf(dist_pool, tiny_bert_dir, preset, checkpointing):
    plan = Plan.preset(preset)
    t = TINY_BERT
    expected = bert_plan_comm_bytes(plan, seq_shares=SHARES[2], batch=B, hidden=t["hidden_size"],
                                    layers=t["num_hidden_layers"], intermediate=t["intermediate_size"],
                                    comm_chunks=3)
    for rank, (worst, comm) in enumerate(dist_pool(2).run(chunked_vs_whole, tiny_bert_dir, plan, checkpointing)):
        for key, err in worst.items():
            assert err < 1e-5, (rank, key, worst)
        if checkpointing == "none":     # recomputation repeats forward collectives
            assert comm == expected, (rank, comm, expected)
