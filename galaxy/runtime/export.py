"""Export a trained model as a Hugging Face folder, whatever plan and world size trained it.

    out_dir/config.json          the base model's config + num_labels, id2label, label2id,
                                 architectures = the family's *ForSequenceClassification
    out_dir/model.safetensors    full (gathered) weights under Hugging Face names
    out_dir/tokenizer*.json      the tokenizer the data was encoded with

so that e.g. BertForSequenceClassification.from_pretrained(out_dir) gives galaxy's logits, and
build_model(out_dir, ...) rebuilds the model under any plan (that is how checkpoints resume).
Under pipeline parallelism the stages' weights are gathered to the writer (global rank 0) first
(galaxy.pipeline.stage_state), so the folder is the one a pp_deg 1 run writes.
"""
from __future__ import annotations

import os
import shutil
import tempfile

import torch

from galaxy.models.build import load_hf_config
from galaxy.models.registry import family_of_model
from galaxy.parallel.full_state import gather_full
from galaxy.models.attached import written_names
from galaxy.pipeline.stage_state import in_writer_replica, stages_to_writer
from galaxy.files import fsync_path, replace_with, write_safetensors_atomic, write_text_atomic


def hf_state_dict(model, mesh=None) -> dict[str, torch.Tensor] | None:
    """Full parameters by Hugging Face name, on the CPU.

    mesh None: collective over the Galaxy group, every rank gets its model's (or stage's) dict.
    mesh given: collective over every rank; the writer (global rank 0) gets the whole model's,
    every pipeline stage's; ranks that do not write may get None.
    """
    if not in_writer_replica(mesh, model):
        return None
    full = gather_full(model, names=written_names(model))
    # Hugging Face names and layout (e.g. GPT-2's Conv1D weights transposed back to [in, out]).
    part = family_of_model(model).hf_state(model.config, {n: t.to("cpu") for n, t in full.items()})
    return stages_to_writer(mesh, {n: t.contiguous() for n, t in part.items()})


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
              lead: bool, mesh=None) -> None:
    """Collective (every rank calls it); only the lead rank writes. With several pipeline stages
    the mesh is needed (and lead must be global rank 0, the writer)."""
    state = hf_state_dict(model, mesh)
    if lead:
        write_hf_dir(out_dir, classifier_config(base_model_path, class_names), state, tokenizer)
