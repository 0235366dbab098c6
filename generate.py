"""Complete prompts with a causal LM (Llama, Qwen2, GPT-2) or an encoder-decoder (BART, T5) under
any plan of the config: KV-cached, greedy or sampled. See docs/inference.md; run with --help for
the arguments."""
from galaxy.inference.generate_job import add_generate_arguments, prepare_generate, run_generate
from galaxy.launch import main

if __name__ == "__main__":
    main(preset="galaxy", prepare_fn=prepare_generate, train_fn=run_generate, add_arguments=add_generate_arguments,
         script="generate.py", default_config="train_config/llama/full.json", model_type="llama")
