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
  MLP SP      S in, S out                 R -> R in, P -> R (token sum) out: every rank holds the
                                          whole MLP, so it computes its decode columns (the
                                          plan's decode_columns) from views of its weights
                                          (FeedForward.decode_on_columns), summed as TP's
  CON         S or R                      R: every rank holds the token's stream
  embeddings  R -> CON layout             R -> R

So a decode step costs one sum of a token's partial output per TP sub-block and SP MLP, and one
small all-gather per SP ATT. An SP MLP whose projections carry LoRA computes the whole token on
every rank, as before (R out). An SP ATT keeps its token split while decoding: decoding it by
heads would need its cache, every head of its own tokens, laid out again by heads after the
prefill (one all-to-all per generate call), not done.

Decoding runs under no_grad, so the transitions are plain functions, no autograd (an R -> R into
a TP sub-block, whose backward would all-reduce, is the identity), and
a TP output's sum is the primitive `token_sum` names: a one-token sum of a few KB costs its
rounds of messages, not its bytes, and a ring all-reduce takes 2 (n - 1) rounds where an
all-to-all and a local sum take one. "socket" (the default on CPU): the same all-to-all's
arithmetic over the group's own TCP connections (galaxy.distributed.token_link, made by the
engine), without gloo's thread hand-offs; gloo's primitives (galaxy.distributed.transitions.
TOKEN_SUMS): "all_to_all" (the default elsewhere), "exchange" (a paired send and receive, groups of
two only), "all_reduce" (gloo's ring).

An encoder-decoder (a model with `enter_decoder`) decodes only with its decoder: the encoder runs
once, at the first pass, under the plan's layouts (its entry, its layers and the memory's
gather keep them); the decoder's entry and layers take the decode layouts, XATT as ATT (TP: its
heads, P -> R out; SP: every rank attends the token with all heads to the K/V of its own source
tokens, merged across the ranks as ATT SP's partial outputs are).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from galaxy.distributed.transitions import TOKEN_SUMS, Transition

SOCKET = "socket"
TOKEN_SUM_NAMES = (SOCKET, *sorted(TOKEN_SUMS))


def default_token_sum(device) -> str:
    """The token sum an engine takes unless told: the group's own sockets on CPU (gloo's
    devices), gloo's or NCCL's all-to-all on an accelerator."""
    return SOCKET if torch.device(device).type == "cpu" else "all_to_all"


@contextmanager
def decode_layouts(model, token_sum: str = "all_to_all", link=None):
    """Inside: the model's transitions as the decode phase wants them (under no_grad); the plan's
    again after. token_sum: the primitive of a TP sub-block's P -> R (TOKEN_SUMS, or "socket" over
    `link`, the group's TokenLink)."""
    saved = [(t, t.fn, t.label) for t in model.modules() if isinstance(t, Transition)]
    plan, group = model.attached.plan, model.attached.group
    encoder_decoder = hasattr(model, "enter_decoder")
    if token_sum == SOCKET and link is None and group.size > 1:
        raise ValueError("token_sum 'socket' needs the group's TokenLink (galaxy.distributed.token_link)")
    summed = (link and link.sum_over) if token_sum == SOCKET else TOKEN_SUMS[token_sum]
    try:
        (model.enter_decoder if encoder_decoder else model.enter).use(None, "R->R", group)
        for layer in model.layers:
            if encoder_decoder and layer.sequence == "source":
                continue
            for name, into, out in layer.parts():
                split = plan.method(name) == "TP" or (name == "mlp" and _split_mlp(layer.mlp, plan, group))
                into.use(None, "R->R" + (" (split consumer)" if split else ""), group)
                out.use(summed if split else None, f"P->R by {token_sum}" if split else "R->R", group)
        yield
    finally:
        for t, fn, label in saved:
            t.fn, t.label = fn, label
        for layer in model.layers:
            layer.mlp.decode_on_columns(None)


def _split_mlp(mlp, plan, group) -> bool:
    """Set an SP MLP to compute its rank's decode columns; whether it does (a group of two or
    more, plain projections)."""
    if plan.mlp != "SP" or group.size == 1 or not mlp.splits_columns():
        return False
    shares = plan.decode_mlp_columns(mlp.intermediate)
    mlp.decode_on_columns(sum(shares[:group.rank]), shares[group.rank])
    return True
