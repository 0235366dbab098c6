"""Llama causal-LM fine-tuning (serial, any Galaxy plan, dp_deg / pp_deg mesh), or --generate.

See README.md; run with --help for the arguments.
"""
from galaxy.launch import main
from galaxy.preflight import check_tokenizer_files
from galaxy.inference.finetune_generate import add_generation_arguments, prepare_llama, run_llama


def prepare(cfg, args):
    check_tokenizer_files(cfg.model_path)      # --generate needs the tokenizer as training does
    return prepare_llama(cfg, args)


if __name__ == "__main__":
    main(preset="galaxy", prepare_fn=prepare, train_fn=run_llama, add_arguments=add_generation_arguments,
         script="finetune_llama.py",
         default_config="train_config/llama/full.json", model_type="llama")
