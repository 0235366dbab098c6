"""This rank's part of the model for inference: the weights training would start from (model_path,
or the checkpoint `resume` names), its shard under the plan, its pipeline stage, and the PEFT
method of the config as training applies it (LoRA from lora_path or the checkpoint; with
merge_lora the update is folded into the weights once, so decoding costs no more than the base
model)."""
from __future__ import annotations

import torch

from galaxy.inference.engine import Engine
from galaxy.inference.seq2seq_engine import Seq2SeqEngine
from galaxy.models.weights import read_hf_state_dict
from galaxy.peft import apply_peft
from galaxy.peft.lora import fold_into_weights
from galaxy.runtime.assemble import build_model
from galaxy.runtime.runners import stage_of


def inference_model(cfg, plan, mesh, *, resume, peft, device, task: str = "causal_lm", num_labels=None):
    """Collective-free: every rank reads only its own slices (galaxy.runtime.assemble)."""
    torch.manual_seed(cfg.seed)         # what building draws (a new head, LoRA's A) is the same everywhere
    source = resume.model_dir if resume else cfg.model_path
    model = build_model(source, plan, mesh.galaxy, num_labels=num_labels, seed=cfg.seed, device=device,
                        stage=stage_of(plan, mesh), task=task)
    if peft.method != "full":
        state = read_hf_state_dict(source) if resume else None
        apply_peft(model, peft, seed=cfg.seed, state=state)
        if peft.method == "lora" and cfg.merge_lora:
            fold_into_weights(model)
    return model.eval()


def eos_ids(model_config, tokenizer) -> list[int]:
    """The tokens that end a row: the model's eos_token_id (one or a list, as Hugging Face's
    generate reads it), else the tokenizer's."""
    eos = getattr(model_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return list(eos) if isinstance(eos, (list, tuple)) else [eos]


def generation_task(shape: dict) -> str:
    """The task a generating job builds a model of that shape for (galaxy.models.shape)."""
    return "seq2seq" if shape.get("is_encoder_decoder") else "causal_lm"


def generation_engine(model, plan, mesh, tokenizer, device="cpu"):
    """The KV-cached engine for `model`: an encoder-decoder's (galaxy.inference.seq2seq_engine)
    or a causal LM's (galaxy.inference.engine), stopping at the model's end-of-sequence tokens."""
    kind = Seq2SeqEngine if model.task == "seq2seq" else Engine
    return kind(model, plan, mesh, tokenizer, eos_ids=eos_ids(model.config, tokenizer), device=device)
