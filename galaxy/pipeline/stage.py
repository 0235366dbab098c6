"""One pipeline stage of a model: its own layers, plus the embeddings (first) or head (last).

`keep_stage` prunes a built model (full weights loaded, plan applied) in place. Parameter names
stay those of the full model ("layers.{i}..." with the global layer index i), so the gradient
rules, gather_full, checkpoints and the Hugging Face name map work on a stage unchanged.
`StageModule` is what torch.distributed.pipelining runs: carry in, carry out.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from galaxy.distributed.transitions import Layout
from galaxy.models.attached import StageInfo


class LayerSlice(nn.Module):
    """Some of a model's layers, registered under their global indices; iterates in order."""

    def __init__(self, layers: dict[int, nn.Module]):
        super().__init__()
        for i, layer in sorted(layers.items()):
            self.add_module(str(i), layer)

    def __iter__(self):
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)

    @property
    def indices(self) -> list[int]:
        return [int(k) for k in self._modules]


def _shared_across_ends(model: nn.Module) -> dict[str, str]:
    """Parameters that both the first and the last stage would hold (tied embeddings):
    {name on the last stage: name on the first stage}."""
    first = {id(p): f"{name}.{n}" for name in model.first_stage_modules
             for n, p in getattr(model, name).named_parameters()}
    return {f"{name}.{n}": first[id(p)] for name in model.last_stage_modules
            for n, p in getattr(model, name).named_parameters(remove_duplicate=False) if id(p) in first}


def keep_stage(model: nn.Module, layers: range, first: bool, last: bool) -> nn.Module:
    """Drop everything stage (layers, first, last) does not run; returns the same model.

    A weight tied across the ends (Llama's tie_word_embeddings: lm_head.weight is
    embed_tokens.weight) becomes two parameters when the ends are different stages: the first
    stage keeps it under its own name, the last under the head's. model.attached.tied_across_stages
    ({last-stage name: first-stage name}, the same on every stage) tells the pipeline to sum
    their gradients (galaxy.pipeline.tied), so the two copies stay equal, and tells gathers and
    norms to count the last stage's copy as the first's.
    """
    tied = {} if first and last else _shared_across_ends(model)
    at = model.attached
    rules = at.rules
    model.layers = LayerSlice({i: model.layers[i] for i in layers})
    for name in () if first else model.first_stage_modules:
        delattr(model, name)
    for name in () if last else model.last_stage_modules:
        delattr(model, name)
    kept = {n for n, _ in model.named_parameters()}
    at.rules = {n: r for n, r in rules.items() if n in kept}
    if last and not first:
        at.rules.update({copy: rules[original] for copy, original in tied.items()})
    at.tied_across_stages = tied
    at.stage = StageInfo(layers, first, last)
    return model


@dataclass(frozen=True)
class CarrySlot:
    """One tensor of the carry as it crosses a stage boundary: [rows, s_con, width]."""
    width: int
    trainable: bool       # False: no gradient flows back through it (a frozen backbone's stream)


def carry_slots(model: nn.Module) -> tuple[CarrySlot | None, ...]:
    """One entry per tensor of the model's carry, in carry order; None for one that stays home.

    The carry is the backbone's model.carry_size tensors ([b, s_con, hidden] each), then the side
    state ([b, s_con, side_width]) under side-tuning (galaxy.peft.side). Ladder side-tuning runs
    the backbone without autograd, so its tensors travel without a gradient coming back;
    side-only never runs the backbone's layers, so only the side state travels.
    """
    mode, hidden = getattr(model, "side_mode", None), model.config.hidden_size
    if mode is None:
        return (CarrySlot(hidden, True),) * model.carry_size
    backbone = None if mode == "side_only" else CarrySlot(hidden, False)
    return (backbone,) * model.carry_size + (CarrySlot(model.side_width, True),)


def pack_carry(carry: tuple, slots) -> tuple:
    """The tensors of `carry` that travel to the next stage."""
    return tuple(t for t, slot in zip(carry, slots, strict=True) if slot is not None)


def unpack_carry(tensors: tuple, slots) -> tuple:
    """The carry from what the previous stage sent (None where a tensor stayed home)."""
    received = iter(tensors)
    return tuple(None if slot is None else next(received) for slot in slots)


def carry_shapes(model: nn.Module, con_layout: Layout, rows: int, seq_len: int) -> list[tuple[tuple, bool]]:
    """(shape, trainable) of every travelling carry tensor: [rows, s_con, width], s_con = own
    tokens under a sequence-sharded CON layout."""
    g = model.attached.group
    s_con = g.tokens[g.rank] if con_layout == Layout.S and g.size > 1 else seq_len
    return [((rows, s_con, slot.width), slot.trainable) for slot in carry_slots(model) if slot is not None]


class StageModule(nn.Module):
    """Runs one stage. First stage: (input_ids [b, S],) in; others: the travelling carry tensors.

    Every stage gets the micro-batch's attention_mask [b, S] as a keyword argument (pipelining
    splits keyword tensors into micro-batches for every stage), so no mask travels between stages.
    Returns the travelling carry; the last stage's head and loss run in the schedule's loss
    function (on unpack_carry of it).
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *inputs, attention_mask, token_type_ids=None):
        m = self.model
        slots = carry_slots(m)
        carry = m.embed(inputs[0], token_type_ids) if m.attached.is_first_stage else unpack_carry(inputs, slots)
        dtype = carry_dtype(m)
        return tuple(t.to(dtype) for t in pack_carry(m.run_layers(tuple(carry), m.layer_context(attention_mask),
                                                                  m.layers), slots))


def carry_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the travelling carry crosses a stage boundary in: the parameters'.

    The receiving stage allocates its buffers before any forward runs, but under bf16 autocast
    what a stage returns depends on the last op: the residual stream (a bf16 output added to an
    fp32 stream) is fp32, the side network's state (a linear's output) bf16. A bf16 tensor sent
    into an fp32 buffer does not arrive as its values: pp 2 with side-tuning under bf16 trained
    on NaN from step 1. The cast up is exact, and the next stage's autocast casts back down.
    """
    return next(model.parameters()).dtype


def example_carry(model: nn.Module, con_layout: Layout, rows: int, seq_len: int, dtype: torch.dtype) -> tuple:
    """Meta tensors describing the travelling carry, for the stage's static send/receive buffers.

    requires_grad marks a tensor as differentiable: the stage that receives it sends its gradient
    back only if so (a frozen backbone's stream gets none).
    """
    return tuple(torch.empty(shape, dtype=dtype, device="meta", requires_grad=trainable)
                 for shape, trainable in carry_shapes(model, con_layout, rows, seq_len))
