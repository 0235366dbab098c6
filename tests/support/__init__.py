"""Test helpers: the shared process pools and command drivers, the tiny models, and the runners
that train a plan beside its reference (Hugging Face, peft, a single process)."""
