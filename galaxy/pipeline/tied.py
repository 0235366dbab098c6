"""Weights tied across the two ends of a pipeline: one gradient for two copies.

With tie_word_embeddings a causal LM multiplies by the same matrix at both ends: the embedding
lookup (first stage) and the LM head (last stage). keep_stage leaves each end its own copy,
equal at the start (both loaded from the one checkpoint tensor). The serial gradient of the
tied weight is the sum of the two uses' gradients, so after every backward each copy's
gradient is all-reduced over the pair {stage 0 rank, last-stage rank} of the same data-parallel
replica and Galaxy rank (galaxy.distributed.mesh.pipeline_ends_group); both copies then take
identical optimizer steps and stay equal. Middle stages hold neither copy.
"""
from __future__ import annotations

from galaxy.distributed import waiting
from galaxy.distributed.mesh import pipeline_ends_group
from galaxy.parallel.dtensors import local


class TiedWeightSync:
    def __init__(self, model, mesh):
        tied = model.attached.tied_across_stages     # the same on every stage
        # Built only for tied models, but then on every rank: making groups is collective.
        self.pg = pipeline_ends_group(mesh) if tied else None
        params = dict(model.named_parameters())
        # One entry per tied pair, in the same order on both ends.
        ends = [original if model.attached.is_first_stage else copy for copy, original in tied.items()]
        self.params = [params[n] for n in ends if n in params]

    def __call__(self) -> None:
        """After backward (and the data-parallel average), before the optimizer step."""
        for p in self.params:
            if p.requires_grad:       # frozen under PEFT: frozen on both ends alike
                # dp_sharding: both copies have one shape, so both ends hold the same dp slice
                waiting.all_reduce(local(p.grad), group=self.pg)
