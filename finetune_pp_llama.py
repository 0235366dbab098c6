"""Llama causal-LM fine-tuning with pipeline parallelism (pp_deg = world unless the config says).

See README.md; run with --help for the arguments.
"""
from galaxy.launch import main
from galaxy.train.trainer import prepare_causal_lm, train

if __name__ == "__main__":
    main(preset="pp", prepare_fn=prepare_causal_lm, train_fn=train, script="finetune_pp_llama.py",
         default_config="train_config/llama/pp/full.json", model_type="llama")
