"""One pipeline stage of a model: its own layers, plus the embeddings (first) or head (last).

`keep_stage` prunes a built model (full weights loaded, plan applied) in place. Parameter names
stay those of the full model ("layers.{i}..." with the global layer index i), so the gradient
rules, gather_full, checkpoints and the Hugging Face name map work on a stage unchanged.
`StageModule` is what torch.distributed.pipelining runs: carry in, carry out.
"""
from __future__ import annotations

from torch import nn

from galaxy.models.attached import StageInfo
# The carry's helpers, where the stage's users (the runner, generation) have always found them.
from galaxy.pipeline.carry import (CarrySlot, carry_dtype, carry_shapes, carry_slots, decoding_slots,  # noqa: F401
                                   example_carry, pack_carry, stage_slots, unpack_carry)


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


def stack_layers(layers) -> dict[str, range]:
    """{layer.sequence: the indices of that stack's layers} of a whole model's layers (contiguous:
    an encoder-decoder's encoder, then its decoder)."""
    spans: dict[str, list[int]] = {}
    for i, layer in enumerate(layers):
        spans.setdefault(layer.sequence, []).append(i)
    return {sequence: range(ix[0], ix[-1] + 1) for sequence, ix in spans.items()}


def keep_stage(model: nn.Module, layers: range, first: bool, last: bool) -> nn.Module:
    """Drop everything stage (layers, first, last) does not run; returns the same model.

    A weight tied across the ends (Llama's tie_word_embeddings: lm_head.weight is
    embed_tokens.weight) becomes two parameters when the ends are different stages: the first
    stage keeps it under its own name, the last under the head's. model.attached.tied_across_stages
    ({last-stage name: first-stage name}, the same on every stage) tells the pipeline to sum
    their gradients (galaxy.pipeline.tied), so the two copies stay equal, and tells gathers and
    norms to count the last stage's copy as the first's.

    A stack module (model.stack_modules: T5's position bias tables, read by every layer of one
    stack through the layer context) stays on the stages holding layers of its stack; where its
    stack spans several stages each holds an equal copy under the same name, their gradients are
    summed the same way, and only the stage with the stack's first layer writes it
    (model.attached.stage_copies on the others).
    """
    tied = {} if first and last else _shared_across_ends(model)
    at = model.attached
    rules, stacks = at.rules, stack_layers(model.layers)
    model.layers = LayerSlice({i: model.layers[i] for i in layers})
    for name in () if first else model.first_stage_modules:
        delattr(model, name)
    for name in () if last else model.last_stage_modules:
        delattr(model, name)
    copies = set()
    for sequence, names in model.stack_modules.items():
        span = stacks.get(sequence, range(0))
        for name in names:
            if not set(span) & set(layers):
                delattr(model, name)
            elif span.start not in layers:
                copies |= {f"{name}.{n}" for n, _ in getattr(model, name).named_parameters()}
    kept = {n for n, _ in model.named_parameters()}
    at.rules = {n: r for n, r in rules.items() if n in kept}
    if last and not first:
        at.rules.update({copy: rules[original] for copy, original in tied.items()})
    at.tied_across_stages, at.stage_copies = tied, frozenset(copies)
    at.stage = StageInfo(layers, first, last, stacks)
    return model


class StageModule(nn.Module):
    """Runs one stage. First stage: (input_ids [b, S],) in; others: the travelling carry tensors
    (galaxy.pipeline.carry: what crosses each boundary).

    Every stage gets the micro-batch's attention_mask [b, S] as a keyword argument (pipelining
    splits keyword tensors into micro-batches for every stage), so no mask travels between stages;
    an encoder-decoder's stages also get its target mask (decoder_attention_mask [b, T]), the
    first its decoder_input_ids [b, T] (stack_inputs: what embed and layer_context take beyond the
    source's). Returns the travelling carry; the last stage's head and loss run in the schedule's
    loss function (on unpack_carry of it).
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *inputs, attention_mask, token_type_ids=None, **stack_inputs):
        m = self.model
        received, sent = stage_slots(m)
        if m.attached.is_first_stage:
            carry = m.embed(inputs[0], token_type_ids, **stack_inputs)
        else:
            carry = unpack_carry(inputs, received)
        carry = m.run_layers(tuple(carry), m.layer_context(attention_mask, **stack_inputs), m.layers)
        dtype = carry_dtype(m)
        return tuple(t.to(dtype) for t in pack_carry(carry, sent))
