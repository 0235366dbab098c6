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
from galaxy.distributed.streams import cut_context, stream_delays, stream_rows
from galaxy.models import family
from galaxy.plan import Plan
from galaxy.runtime.assemble import build_model

SHARES = ((4, 2), (64, 32), (7, 5))


def record_order(model_dir, sizes=(3, 2)):
    """[(phase, "comm" | sub-block name, rows)] in the order collectives start and sub-blocks run
    (backward: when the sub-block's output gradient is ready, i.e. as its backward begins), with
    the batch's rows cut into streams of `sizes` rows (distinct, so rows name the stream)."""
    model = build_model(model_dir, Plan.preset("galaxy", batch_streams=len(sizes)), world_group(*SHARES),
                        num_labels=3, dropout=0.0)
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
    family.stream_rows = lambda rows, streams: list(sizes)      # near-equal cuts would repeat a size
    try:
        _, loss = model(**tiny_batch(seed=0, batch=sum(sizes)))
        phase[0] = "backward"
        loss.backward()
    finally:
        collectives.comm_recorder, family.stream_rows = None, stream_rows
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


def test_three_streams_hide_every_collective_behind_a_big_sub_block(dist_pool, tiny_bert_dir):
    # Streams of 3, 2 and 1 rows, the middle one a step out of phase (stream_delays): between a
    # stream's started collective and that stream's next work, another stream runs its ATT or MLP,
    # whether the collective left an ATT or MLP (a reduce-scatter) or a CON (an all-gather). In
    # phase, half of them would see only the other streams' CONs.
    assert stream_delays(2) == [0, 0] and stream_delays(3) == [0, 1, 0] and stream_delays(4) == [0, 1, 0, 1]
    for log in dist_pool(2).run(record_order, tiny_bert_dir, (3, 2, 1)):
        for phase in ("forward", "backward"):
            events = [(what, rows) for p, what, rows in log if p == phase and rows in (1, 2, 3)]
            computes = [rows for what, rows in events if what != "comm"]
            assert sorted(computes) == [1] * 4 + [2] * 4 + [3] * 4, (phase, events)
            hidden, exposed = 0, []
            for i, (what, rows) in enumerate(events):
                later = events[i + 1:]
                mine = next((j for j, (_, r) in enumerate(later) if r == rows), len(later))
                if what != "comm" or mine == len(later):      # a stream's last collective: nothing of its own follows
                    continue
                if any(w != "comm" for w, _ in later[:mine]):
                    hidden += 1
                else:
                    exposed.append(i)
            # the very first collective (the first layer's input gather of the first stream) has only
            # the other streams' gathers behind it; every other one has a big sub-block
            assert exposed in ([], [0]), (phase, exposed, events)
            assert hidden >= 20, (phase, hidden)
