"""Export a trained model as a Hugging Face folder, whatever plan and world size trained it.

    out_dir/config.json          the base model's config + num_labels, id2label, label2id,
                                 architectures = the family's *ForSequenceClassification
    out_dir/model.safetensors    full (gathered) weights under Hugging Face names
    out_dir/tokenizer*.json      the tokenizer the data was encoded with

so that e.g. BertForSequenceClassification.from_pretrained(out_dir) gives galaxy's logits, and
build_model(out_dir, ...) rebuilds the model under any plan (that is how checkpoints resume).
"""
from __future__ import annotations

import os
import shutil
import tempfile

import torch

from galaxy.models.build import load_hf_config
from galaxy.models.registry import family_of
from galaxy.parallel.full_state import gather_full
from galaxy.train.files import fsync_path, replace_with, write_safetensors_atomic, write_text_atomic


def hf_state_dict(model) -> dict[str, torch.Tensor]:
    """Collective over the Galaxy group: full parameters by Hugging Face name, on the CPU."""
    to_hf = family_of(model.config.model_type).hf_name_fn(model.config)
    return {to_hf(name): t.to("cpu").contiguous() for name, t in gather_full(model).items()}


def classifier_config(base_model_path: str, class_names: list[str] | None):
    """The base model's config (its own dropout, not a training override) for this task head.

    class_names None (a causal LM): the base model's config as it is.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES
    cfg = load_hf_config(base_model_path)
    if class_names is None:
        return cfg
    cfg.id2label = dict(enumerate(class_names))
    cfg.label2id = {name: i for i, name in enumerate(class_names)}
    cfg.problem_type = "single_label_classification"
    cfg.architectures = [MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES[cfg.model_type]]
    return cfg


def write_hf_dir(out_dir: str, hf_config, state: dict[str, torch.Tensor], tokenizer) -> None:
    """Write (or overwrite) the folder's files, each one atomically; other files are left alone."""
    os.makedirs(out_dir, exist_ok=True)
    write_safetensors_atomic(os.path.join(out_dir, "model.safetensors"), state)
    write_text_atomic(os.path.join(out_dir, "config.json"), hf_config.to_json_string())
    # save_pretrained writes several files non-atomically: stage them, then move each one.
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".tokenizer-") as stage:
        tokenizer.save_pretrained(stage)
        for name in os.listdir(stage):
            source = os.path.join(stage, name)
            if os.path.isfile(source):
                fsync_path(source)
                replace_with(source, os.path.join(out_dir, name))
            else:
                shutil.copytree(source, os.path.join(out_dir, name), dirs_exist_ok=True)


def export_hf(model, out_dir: str, *, base_model_path: str, class_names: list[str] | None, tokenizer,
              lead: bool) -> None:
    """Collective (all ranks gather); only the lead rank writes."""
    state = hf_state_dict(model)
    if lead:
        write_hf_dir(out_dir, classifier_config(base_model_path, class_names), state, tokenizer)
