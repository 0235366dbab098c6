"""What crosses a pipeline stage boundary: which tensors of the carry travel, their shapes, dtype.

A boundary is named by `after`, the number of the whole model's layers before it (stage p's input
boundary is its first layer's index, its output boundary one past its last). A one-stack model's
carry is the same at every boundary: the backbone's carry_size tensors [b, s_con, h], then the
side state under side-tuning. An encoder-decoder's (model.encoder_layers = E > 0; its layers are
the encoder's, then the decoder's) depends on where the boundary is:

    after < E (inside the encoder)   the source carry, n tensors [b, s_src, h], and the target
                                     carry, n tensors [b, s_tgt, h]: the decoder's entered
                                     embeddings, which wait for the first decoder layer
    after >= E                       the encoder's output source[-1] [b, s_src, h] (a pre-norm
                                     stack's stream source[0] is done) and the target carry

(n = model.carry_size; s_src, s_tgt: own tokens of each stack under a sequence-sharded CON
layout, the whole sequence otherwise). Under side-tuning both side states follow at every
boundary, the side encoder's [b, s_src, w] and the side decoder's [b, s_tgt, w]
(galaxy.peft.side_seq2seq), and the backbone's tensors travel without a gradient (side-only:
not at all). The encoder's output crosses the decoder's boundaries in
the CON layout, not gathered: N times fewer bytes under CON SP. Each stage holding decoder layers
gathers it once for its cross-attentions (model.run_layers) and sends the received tensor on
unchanged, so in backward its gradient is the next stage's plus this stage's cross-attentions'
(autograd sums the two uses), and the encoder's last stage receives the sum over every decoder
layer that read it. Masks never travel: every stage gets them as keyword arguments.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from galaxy.distributed.transitions import Layout


@dataclass(frozen=True)
class CarrySlot:
    """One tensor of the carry as it crosses a stage boundary: [rows, s_con, width]."""
    width: int
    trainable: bool       # False: no gradient flows back through it (a frozen backbone's stream)
    sequence: str = "source"      # whose tokens: "source", or an encoder-decoder's "target"


def carry_slots(model: nn.Module, after: int | None = None) -> tuple[CarrySlot | None, ...]:
    """One entry per tensor of the model's carry, in carry order; None for one that stays home.

    after: the boundary (layers before it; None: the first, every tensor of an encoder-decoder's
    carry). The carry is the backbone's model.carry_size tensors ([b, s_con, hidden] each), then
    the side state ([b, s_con, side_width]) under side-tuning (galaxy.peft.side). Ladder
    side-tuning runs the backbone without autograd, so its tensors travel without a gradient
    coming back; side-only never runs the backbone's layers, so only the side state travels.
    A boundary with no trainable parameter below it (at or before the stage's grad_from: LoRA
    targets in later stages' layers only) carries nothing back at all.
    """
    slots = _encoder_decoder_slots(model, after or 0) if model.encoder_layers else _one_stack_slots(model)
    stage = model.attached.stage
    if stage is not None and after and after <= stage.grad_from:     # (0: the first stage's input, ids)
        return tuple(None if slot is None else replace(slot, trainable=False) for slot in slots)
    return slots


def _one_stack_slots(model: nn.Module) -> tuple[CarrySlot | None, ...]:
    mode, hidden = getattr(model, "side_mode", None), model.config.hidden_size
    if mode is None:
        return (CarrySlot(hidden, True),) * model.carry_size
    backbone = None if mode == "side_only" else CarrySlot(hidden, False)
    return (backbone,) * model.carry_size + (CarrySlot(model.side_width, True),)


def _encoder_decoder_slots(model: nn.Module, after: int) -> tuple[CarrySlot | None, ...]:
    """Side-tuning (galaxy.peft.side_seq2seq): the backbone's streams travel without a gradient
    (side-only: not at all), then both side states at every boundary, each split like its stack."""
    n, hidden, mode = model.carry_size, model.config.hidden_size, getattr(model, "side_mode", None)
    source, target = CarrySlot(hidden, not mode, "source"), CarrySlot(hidden, not mode, "target")
    sources = (None,) * (n - 1) + (source,) if after >= model.encoder_layers else (source,) * n
    if mode is None:
        return sources + (target,) * n
    backbone = (None,) * (2 * n) if mode == "side_only" else sources + (target,) * n
    return backbone + (CarrySlot(model.side_width, True, "source"), CarrySlot(model.side_width, True, "target"))


def decoding_slots(slots: tuple) -> tuple:
    """An encoder-decoder's carry_slots while it decodes one token per step: the decoder's stream
    alone (the encoder ran once, at the first pass, and every XATT holds its memory's K/V)."""
    return tuple(slot if slot is not None and slot.sequence == "target" else None for slot in slots)


def stage_slots(model: nn.Module) -> tuple[tuple, tuple]:
    """(what this stage receives, what it sends): carry_slots at its two boundaries."""
    stage = model.attached.stage
    if stage is None:
        return carry_slots(model), carry_slots(model)
    return carry_slots(model, stage.layers.start), carry_slots(model, stage.layers.stop)


def pack_carry(carry: tuple, slots) -> tuple:
    """The tensors of `carry` that travel to the next stage."""
    return tuple(t for t, slot in zip(carry, slots, strict=True) if slot is not None)


def unpack_carry(tensors: tuple, slots) -> tuple:
    """The carry from what the previous stage sent (None where a tensor stayed home)."""
    received = iter(tensors)
    return tuple(None if slot is None else next(received) for slot in slots)


def carry_shapes(model: nn.Module, con_layout: Layout, rows: int, seq_len: int, target_len: int | None = None,
                 after: int | None = None, *, target_layout: Layout | None = None,
                 slots: tuple | None = None) -> list[tuple[tuple, bool]]:
    """(shape, trainable) of every tensor travelling at boundary `after` (carry_slots', or `slots`
    given): [rows, s_con, width], s_con = own tokens under a sequence-sharded CON layout, of the
    source (seq_len) or of an encoder-decoder's target (target_len, in target_layout: con_layout
    unless given; generation's decoder is in R, one token per row)."""
    g = model.attached.group
    slots = carry_slots(model, after) if slots is None else slots

    def s_con(slot: CarrySlot) -> int:
        target = slot.sequence == "target"
        group, full = (g.decoder(), target_len) if target else (g, seq_len)
        layout = target_layout if target and target_layout is not None else con_layout
        return group.tokens[group.rank] if layout == Layout.S and group.size > 1 else full
    return [((rows, s_con(slot), slot.width), slot.trainable) for slot in slots if slot is not None]


def carry_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the travelling carry crosses a stage boundary in: the parameters'.

    The receiving stage allocates its buffers before any forward runs, but under bf16 autocast
    what a stage returns depends on the last op: the residual stream (a bf16 output added to an
    fp32 stream) is fp32, the side network's state (a linear's output) bf16. A bf16 tensor sent
    into an fp32 buffer does not arrive as its values: pp 2 with side-tuning under bf16 trained
    on NaN from step 1. The cast up is exact, and the next stage's autocast casts back down.
    """
    return next(model.parameters()).dtype


def example_carry(model: nn.Module, con_layout: Layout, rows: int, seq_len: int, dtype: torch.dtype,
                  target_len: int | None = None, after: int | None = None) -> tuple:
    """Meta tensors describing the carry travelling at boundary `after`, for the stage's static
    send/receive buffers.

    requires_grad marks a tensor as differentiable: the stage that receives it sends its gradient
    back only if so (a frozen backbone's stream gets none).
    """
    return tuple(torch.empty(shape, dtype=dtype, device="meta", requires_grad=trainable)
                 for shape, trainable in carry_shapes(model, con_layout, rows, seq_len, target_len, after))
