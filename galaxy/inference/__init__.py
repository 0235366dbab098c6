"""Inference under any plan: KV-cached generation (engine.py: prefill, sample, decode; sampling.py;
requests.py; prompts.py; replicas.py), the model as training leaves it (model.py), classifier
predictions, the entry logic of generate.py and `--predict`, and serve.py's OpenAI-compatible
server. docs/inference.md describes them."""
