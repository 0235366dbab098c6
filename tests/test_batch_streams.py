"""Batch streams (the plan's batch_streams): a micro-batch's rows run as streams that take turns at
every sub-block boundary, so one stream's collective travels while another's sub-block computes.

Parity with Hugging Face lives with the parity tests (test_parity_bert: every plan at world 2 with
uneven shares; test_parity_llama: Llama and GPT-2, and with comm_chunks; test_parity_encdec: T5;
checkpointing, a pipeline, LoRA, adapters, bf16: test_activation_checkpointing, test_pipeline,
test_peft_lora, test_peft_adapter_side, test_trainer_step; config errors: test_bad_input). Here: the order things run in, recorded
on tiny BERT at world 2 under the Galaxy preset with 5 rows in 2 streams (3 and 2 rows, so every
collective and every sub-block says by its rows which stream it serves), forward and backward:
after a stream starts a boundary's collective, what runs next is the other stream's work, and
the two streams' sub-blocks alternate (in backward the order the autograd engine gives by
itself: ready nodes in reverse creation order). A batch shorter than the streams runs fewer.
"""
import torch

from support.parity import world_group
from support.tiny_models import tiny_batch

from galaxy.distributed import collectives
from galaxy.distributed.streams import cut_context, stream_rows
from galaxy.plan import Plan
from galaxy.runtime.assemble import build_model

SHARES = ((4, 2), (64, 32), (7, 5))


def record_order(model_dir):
    """[(phase, "comm" | sub-block name, rows)] in the order collectives start and sub-blocks run
    (backward: when the sub-block's output gradient is ready, i.e. as its backward begins)."""
    model = build_model(model_dir, Plan.preset("galaxy", batch_streams=2), world_group(*SHARES), num_labels=3,
                        dropout=0.0)
    log, phase = [], ["forward"]

    def on_output(name):
        def hook(module, args, out):
            out[0].register_hook(lambda g: log.append(("backward", name, g.shape[0])))
            log.append(("forward", name, out[0].shape[0]))
        return hook
    for layer in model.layers:
        for name in ("att", "mlp"):
            getattr(layer, name).register_forward_hook(on_output(name))
    collectives.comm_recorder = lambda kind, t, n: log.append((phase[0], "comm", t.shape[0]))
    try:
        _, loss = model(**tiny_batch(seed=0, batch=5))
        phase[0] = "backward"
        loss.backward()
    finally:
        collectives.comm_recorder = None
    return log


def test_streams_take_turns_in_forward_and_backward(dist_pool, tiny_bert_dir):
    for log in dist_pool(2).run(record_order, tiny_bert_dir):
        for phase in ("forward", "backward"):
            events = [(what, rows) for p, what, rows in log if p == phase]
            computes = [rows for what, rows in events if what != "comm"]
            # 2 layers x (ATT, MLP) per stream, the streams alternating sub-block by sub-block
            assert sorted(computes) == [2] * 4 + [3] * 4, (phase, events)
            assert all(a != b for a, b in zip(computes, computes[1:])), (phase, computes)
            # a stream's started collective is followed at once by the other stream's work
            # (its compute or its own collective), never by more of the same stream's
            streams = [(what, rows) for what, rows in events if rows in (2, 3)]
            for (what, rows), (_, after) in zip(streams, streams[1:]):
                assert what != "comm" or after != rows, (phase, streams)
        assert sum(what == "comm" for p, what, _ in log if p == "backward") >= 8


def test_stream_rows_and_context_cuts():
    assert stream_rows(8, 2) == [4, 4] and stream_rows(5, 2) == [3, 2]
    assert stream_rows(1, 2) == [1]           # a short last batch runs fewer streams
    mask, rotary = torch.ones(5, 1, 4, 4), torch.ones(1, 4, 8)
    parts = cut_context({"mask": mask, "cos": rotary, "cross": {"mask": mask}}, 5, [3, 2])
    assert [p["mask"].shape[0] for p in parts] == [3, 2] and [p["cross"]["mask"].shape[0] for p in parts] == [3, 2]
    assert all(p["cos"] is rotary for p in parts)     # a broadcast table stays whole
