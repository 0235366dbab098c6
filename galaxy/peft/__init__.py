"""Parameter-efficient fine-tuning: LoRA (peft's format), bottleneck adapters, ladder side-tuning.

    trainable = apply_peft(model, PeftOptions.from_config(cfg), seed=cfg.seed)
    ...train...
    export_peft(model, out_dir, base_model_path=cfg.model_path, lead=rank == 0, merge=cfg.merge_lora)
"""
from galaxy.peft.apply import PeftOptions, apply_peft, load_full, parameter_counts, peft_summary
from galaxy.peft.export import export_peft, merged_hf_state

__all__ = ["PeftOptions", "apply_peft", "export_peft", "load_full", "merged_hf_state",
           "parameter_counts", "peft_summary"]
