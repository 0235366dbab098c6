"""Write what a PEFT run trained, whatever plan and world size trained it.

    lora                 a peft adapter directory (galaxy.peft.peft_format): full tensors, HF
                         module names; PeftModel.from_pretrained(<HF model>, out_dir) reproduces
                         galaxy's logits
    lora, merge=True     a plain Hugging Face checkpoint with W + scaling * B A folded in
                         (galaxy.runtime.export's folder: config, model.safetensors, tokenizer)
    adapter, side(_only) galaxy_peft.json (method, options, base model) and
                         peft_model.safetensors: the trained tensors (new parameters and the task
                         head) in full, under the Hugging Face-style names of the family's map

Under pipeline parallelism (mesh given) every stage gathers and transforms its own part (LoRA
merges happen on the stage that holds the projection) and the parts meet on the writer, global
rank 0 (galaxy.pipeline.stage_state): the files are those a pp_deg 1 run writes.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict

import torch

from galaxy.models.build import load_hf_config
from galaxy.models.registry import family_of_model
from galaxy.parallel.full_state import gather_full
from galaxy.peft.lora import merge_into
from galaxy.peft.peft_format import lora_config_json, peft_key, write_lora_dir
from galaxy.files import write_safetensors_atomic, write_text_atomic
from galaxy.models.attached import written_names
from galaxy.pipeline.stage_state import in_writer_replica, stages_to_writer
from galaxy.runtime.export import classifier_config, write_hf_dir

GALAXY_CONFIG, GALAXY_WEIGHTS = "galaxy_peft.json", "peft_model.safetensors"


def trained_state(model, mesh=None) -> dict[str, torch.Tensor] | None:
    """The trained tensors in full, by Hugging Face name, on the CPU.

    mesh None: collective over the Galaxy group, every rank gets its model's (or stage's) part.
    mesh given: collective over every rank; the writer (global rank 0) gets every stage's,
    ranks that do not write may get None. The same holds for the two functions below.
    """
    if not in_writer_replica(mesh, model):
        return None
    full = gather_full(model, names=written_names(model, set(model.attached.peft.trainable)))
    return stages_to_writer(mesh, _hf_cpu(model, full))


def lora_adapter_state(model, mesh=None) -> dict[str, torch.Tensor] | None:
    """peft's adapter_model.safetensors tensors (peft keys)."""
    state = trained_state(model, mesh)
    return None if state is None else {peft_key(hf): t for hf, t in state.items()}


def merged_hf_state(model, mesh=None) -> dict[str, torch.Tensor] | None:
    """Every weight by Hugging Face name with the LoRA updates folded in."""
    if not in_writer_replica(mesh, model):
        return None
    merged = merge_into(gather_full(model, names=written_names(model)), model)   # this stage's LoRA
    return stages_to_writer(mesh, _hf_cpu(model, merged))


def _hf_cpu(model, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole tensors by galaxy name -> CPU tensors by Hugging Face name, in Hugging Face's layout
    (a transposed Conv1D weight; LoRA's A [r, in] and B [out, r] are peft's layout as they are)."""
    state = family_of_model(model).hf_state(model.config, {n: t.to("cpu") for n, t in full.items()})
    return {n: t.contiguous() for n, t in state.items()}


def export_peft(model, out_dir: str, *, base_model_path: str, lead: bool, merge: bool = False,
                class_names: list[str] | None = None, tokenizer=None, mesh=None) -> None:
    """Collective over the Galaxy group (all ranks gather), or over every rank when the mesh is
    given (needed with several pipeline stages; lead must then be global rank 0, the writer);
    only the lead rank writes.

    class_names / tokenizer: for merge=True (the HF config's labels, the tokenizer files;
    default: the base model's tokenizer).
    """
    peft = model.attached.peft
    method = peft.options.method
    if method == "full":
        raise ValueError("export_peft exports PEFT runs; a full fine-tuning run uses galaxy.runtime.export.export_hf")
    if merge and method != "lora":
        raise ValueError(f"merge_lora merges LoRA updates; method {method!r} has none to merge")
    if merge:
        state = merged_hf_state(model, mesh)
        if lead:
            if tokenizer is None:
                from transformers import AutoTokenizer
                tokenizer = AutoTokenizer.from_pretrained(base_model_path)
            cfg = classifier_config(base_model_path, class_names) if class_names else load_hf_config(base_model_path)
            write_hf_dir(out_dir, cfg, state, tokenizer)
        return
    if method == "lora":
        state = lora_adapter_state(model, mesh)
        if lead:
            fan_in_fan_out = family_of_model(model).lora_fan_in_fan_out
            write_lora_dir(out_dir, lora_config_json(peft.lora, model, base_model_path, fan_in_fan_out), state)
        return
    state = trained_state(model, mesh)
    if lead:
        os.makedirs(out_dir, exist_ok=True)
        write_safetensors_atomic(os.path.join(out_dir, GALAXY_WEIGHTS), state)
        doc = {"method": method, "options": asdict(peft.options), "base_model_name_or_path": base_model_path,
               "model_type": model.config.model_type, "description": peft.description}
        write_text_atomic(os.path.join(out_dir, GALAXY_CONFIG), json.dumps(doc, indent=2) + "\n")
