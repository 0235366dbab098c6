"""ignore_mismatched_sizes: a classifier head sized for another label set, started afresh.

Hugging Face's from_pretrained(..., ignore_mismatched_sizes=True) drops a checkpoint tensor whose
shape differs from the model's and initialises it anew. Galaxy does the same for the task head
only (a mismatch anywhere else means the weights belong to another model, which preflight
refuses): the model is built with the checkpoint's head, so that every weight loads as usual
under any plan and pipeline, then the head is replaced by one of the task's size, drawn as the
build draws a head the checkpoint lacks (normal(0, initializer_range) from the run's seed, zero
bias): the same values as starting from a checkpoint without a head.
"""
from __future__ import annotations

import torch
from torch import nn

from galaxy.models.build import load_hf_config
from galaxy.models.registry import family_of
from galaxy.preflight.weights import WeightIndex, classifier_rows


def checkpoint_head_rows(model_dir: str) -> int | None:
    """Outputs of the classifier in model_dir's weights (headers only); None when it has none."""
    hf_config = load_hf_config(model_dir)
    found = classifier_rows(WeightIndex(model_dir, "model_path"), family_of(hf_config.model_type), hf_config)
    return found[0] if found else None


@torch.no_grad()
def replace_classifier(model: nn.Module, num_labels: int, seed: int) -> None:
    """Give `model` (or its pipeline stage, when it holds the head) a new classes layer
    (model.classes_layer: BERT's classifier, Llama's score, BART's and T5's out_proj) of num_labels."""
    path = model.classes_layer
    parent_path, _, leaf = path.rpartition(".")
    try:
        parent = model.get_submodule(parent_path)
        old = getattr(parent, leaf)
    except AttributeError:
        return
    new = nn.Linear(old.in_features, num_labels, bias=old.bias is not None, device=old.weight.device,
                    dtype=old.weight.dtype)
    gen = torch.Generator().manual_seed(seed)
    std = getattr(model.config, "initializer_range", 0.02)
    new.weight.copy_(torch.empty(new.weight.shape, dtype=new.weight.dtype).normal_(0.0, std, generator=gen))
    if new.bias is not None:
        new.bias.zero_()
    setattr(parent, leaf, new)
    model.num_labels = num_labels
