"""Serve a causal LM (Llama, Qwen2, GPT-2) or an encoder-decoder (BART, T5) under any plan of the
config over an OpenAI-compatible HTTP API on rank 0 (/v1/completions, /v1/chat/completions,
/v1/models). See docs/inference.md; run with --help for the arguments."""
from galaxy.inference.serve_job import add_serve_arguments, prepare_serve, run_serve
from galaxy.launch import main

if __name__ == "__main__":
    main(preset="galaxy", prepare_fn=prepare_serve, train_fn=run_serve, add_arguments=add_serve_arguments,
         script="serve.py", default_config="train_config/llama/full.json", model_type="llama")
