"""The decode phase's layouts: one new token per row, replicated on every rank of the group.

A plan's transitions (apply_plan) are made for a whole sequence: under CON SP the residual stream
is split by tokens. Decoding feeds one token per row, which cannot be split, so while decoding
the CON layout is R on every rank and each sub-block keeps its method where one token allows:

  sub-block   prefill (the plan's)        decode
  TP          as the plan                 R -> R (identity) in, P -> R (all-reduce) out: heads or
                                          columns still split, the output summed
  ATT SP      S in, S out                 R in, R out: every rank projects the token (all heads),
                                          attends to its own cached tokens, and the partial
                                          outputs are merged (galaxy.layers.cached_attention)
  MLP SP      S in, S out                 R in, R out: every rank computes the token's MLP
  CON         S or R                      R: every rank holds the token's stream
  embeddings  R -> CON layout             R -> R

So a decode step costs one all-reduce per TP sub-block and one small all-gather per SP ATT.

An encoder-decoder (a model with `enter_decoder`) decodes only with its decoder: the encoder runs
once, at the first pass, under the plan's layouts (its entry, its layers and the memory's
gather keep them); the decoder's entry and layers take the decode layouts, XATT as ATT (TP: its
heads, P -> R out; SP: every rank attends the token with all heads to the whole memory's K/V).
"""
from __future__ import annotations

from contextlib import contextmanager

from galaxy.distributed.transitions import Layout, Transition


@contextmanager
def decode_layouts(model):
    """Inside: the model's transitions as the decode phase wants them; the plan's again after."""
    saved = [(t, t.fn, t.label) for t in model.modules() if isinstance(t, Transition)]
    plan, group = model.attached.plan, model.attached.group
    encoder_decoder = hasattr(model, "enter_decoder")
    try:
        (model.enter_decoder if encoder_decoder else model.enter).set(Layout.R, Layout.R, sharded_consumer=False,
                                                                      group=group)
        for layer in model.layers:
            if encoder_decoder and layer.sequence == "source":
                continue
            for name, into, out in layer.parts():
                tp = plan.method(name) == "TP"
                into.set(Layout.R, Layout.R, sharded_consumer=tp, group=group)
                out.set(Layout.P if tp else Layout.R, Layout.R, sharded_consumer=False, group=group)
        yield
    finally:
        for t, fn, label in saved:
            t.fn, t.label = fn, label
