"""Weights several pipeline stages hold copies of: one gradient for all the copies.

Two kinds (galaxy.pipeline.stage.keep_stage makes the copies, equal at the start: each loaded
from the one checkpoint tensor):

  tied across the ends   with tie_word_embeddings a causal LM (or BART, T5 v1.0) multiplies by
                         the same matrix at both ends: the embedding lookup (first stage) and
                         the LM head (last stage). The first stage holds it under the table's
                         name, the last under the head's.
  stack modules          read by every layer of one stack through the layer context (T5's
                         relative position bias tables, model.stack_modules): every stage
                         holding layers of the stack holds the module, under its own name.

The serial gradient is the sum over every use, so after every backward each copy's gradient is
all-reduced over the stages holding a copy, among the ranks of the same data-parallel replica and
Galaxy rank (galaxy.distributed.mesh.stages_group); the copies then take identical optimizer
steps and stay equal. Stages holding none take no part.
"""
from __future__ import annotations

from galaxy.distributed import waiting
from galaxy.distributed.mesh import pipeline_ends_group, stages_group
from galaxy.parallel.dtensors import local


class TiedWeightSync:
    def __init__(self, model, mesh, stage_layers: list[range]):
        """stage_layers: every stage's layers (the resolved plan's stage_layers())."""
        at, params = model.attached, dict(model.named_parameters())
        self.copies = []      # (group, [this stage's copies]), in the same order on every rank
        tied = at.tied_across_stages     # the same on every stage
        if tied:      # groups are made only where needed, but then on every rank: it is collective
            # One entry per tied pair, in the same order on both ends.
            ends = [original if at.is_first_stage else copy for copy, original in tied.items()]
            self.copies.append((pipeline_ends_group(mesh), [params[n] for n in ends if n in params]))
        for sequence, names in sorted(model.stack_modules.items()):
            span = set(at.stage.stacks.get(sequence, ()))
            holders = [p for p, layers in enumerate(stage_layers) if span & set(layers)]
            held = [p for name in names for n, p in params.items() if n.startswith(name + ".")]
            self.copies.append((stages_group(mesh, holders), held))

    def __call__(self) -> None:
        """After backward (and the data-parallel average), before the optimizer step."""
        for pg, params in self.copies:
            if pg is None:
                continue
            for p in params:
                if p.requires_grad:       # frozen under PEFT: frozen on every stage alike
                    # dp_sharding: the copies have one shape, so every stage holds the same dp slice
                    waiting.all_reduce(local(p.grad), group=pg)
