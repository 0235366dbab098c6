"""A randomly initialised model from a config's shape keys: Galaxy-LM's "pretrain from scratch".

A config with shape keys (hidden_size, num_hidden_layers, ...; galaxy.config.SHAPE_KEYS) and no
model_path trains a new model of that shape: `ensure_model` writes it as an ordinary Hugging Face
folder and points model_path at it, so everything downstream (sharded loading, checkpoints,
export) treats it like any pretrained model. The folder holds

  config.json          transformers' config of the family (AutoConfig.for_model(model_type, **shape)),
                       vocab_size defaulting to the tokenizer's size, its special token ids
  model.safetensors    the family's random_init_class (FamilySpec) with transformers' own weight
                       init, drawn after torch.manual_seed(seed)
  tokenizer files      the family's default tokenizer (FamilySpec.default_tokenizer)
  galaxy_random_init.json   what it is, for the note line

under runs/random_init/{model_type}-{key} (relative to the current directory), key = a hash of
everything the weights depend on: the family, the shape keys as given, the seed, the tokenizer
and the transformers and torch versions. Ranks call this before any process group starts; each
computes the same folder, the first one on a machine builds it (the others wait on a lock file,
then reuse it) and renames it into place complete, so a folder under its final name is always
whole. Ranks on different machines build identical folders (same seed, same init).
"""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import tempfile

from galaxy.config import SHAPE_KEYS, ConfigError
from galaxy.models.registry import family_of

CACHE = os.path.join("runs", "random_init")
INFO = "galaxy_random_init.json"
_RECIPE = 1     # bump when the folder's contents change for the same key


def given_shape(cfg) -> dict:
    return {key: getattr(cfg, key) for key in SHAPE_KEYS if getattr(cfg, key) is not None}


def ensure_model(cfg, default_model_type: str | None):
    """cfg itself when it names a model_path; else a copy whose model_path is the random model
    of cfg.model_type (default: the entry script's family) and the shape keys, built if missing.
    Adds its note line (and shape keys the family has no setting for, to the ignored keys)."""
    if cfg.model_path is not None:
        return cfg
    model_type = cfg.model_type or default_model_type
    if model_type is None:
        raise ConfigError("model_type is required for a randomly initialised model (no model_path); "
                          "e.g. \"bert\" or \"llama\"")
    try:
        family = family_of(model_type)
    except ValueError as e:
        raise ConfigError(str(e)) from None      # names model_type and the supported ones
    if family.default_tokenizer is None:
        raise ConfigError(f"{family.name} has no default tokenizer for a randomly initialised model; "
                          f"give model_path (a model folder with its tokenizer)")
    shape = given_shape(cfg)
    key = _key(model_type, shape, cfg.seed, family)
    folder = os.path.abspath(os.path.join(CACHE, f"{model_type}-{key}"))
    built = _build_once(folder, lambda tmp: _write(tmp, family, model_type, shape, cfg.seed))
    with open(os.path.join(folder, INFO), encoding="utf-8") as f:
        info = json.load(f)
    note = (f"no model_path: a randomly initialised {model_type} model ({info['summary']}; "
            f"{info['parameters'] / 1e6:.1f}M parameters; seed {cfg.seed}) with "
            f"{info['tokenizer']}, {'built in' if built else 'reused from'} {_relative(folder)}")
    ignored = info["ignored"]
    return dataclasses.replace(cfg, model_path=folder, model_type=model_type,
                               **{k: None for k in ignored},
                               _notes=(*cfg._notes, note), _ignored=(*cfg._ignored, *ignored))


def _key(model_type: str, shape: dict, seed: int, family) -> str:
    import torch
    import transformers
    what = {"model_type": model_type, "shape": shape, "seed": seed, "class": family.random_init_class,
            "tokenizer": family.default_tokenizer_name, "transformers": transformers.__version__,
            "torch": torch.__version__, "recipe": _RECIPE}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:12]


def _relative(path: str) -> str:
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def _build_once(folder: str, write) -> bool:
    """Build `folder` with write(temp folder) unless it exists; True if this call built it."""
    parent = os.path.dirname(folder)
    os.makedirs(parent, exist_ok=True)
    with open(os.path.join(parent, f".{os.path.basename(folder)}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)        # ranks on this machine: one builds, the rest wait
        if os.path.isdir(folder):
            return False
        tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(folder)}.tmp-")
        try:
            write(tmp)
            os.rename(tmp, folder)              # atomic: the folder appears complete or not at all
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return True


def hf_config_of(family, model_type: str, shape: dict, tokenizer):
    """(transformers config, shape keys the family has no setting for) -> built from the defaults
    of the family's config class, the shape keys, and the tokenizer's size and special tokens."""
    from transformers import AutoConfig
    base = AutoConfig.for_model(model_type)
    ignored = [k for k in shape if not hasattr(base, k)]
    values = {k: v for k, v in shape.items() if k not in ignored}
    if family.random_shape is not None:
        values = family.random_shape(values, tokenizer)
    vocab = len(tokenizer)
    values.setdefault("vocab_size", vocab)
    if values["vocab_size"] < vocab:
        raise ConfigError(f"vocab_size {values['vocab_size']} is smaller than the {vocab} tokens of "
                          f"{family.default_tokenizer_name}; raise vocab_size to at least {vocab} or remove it")
    for name in ("pad", "bos", "eos"):
        token_id = getattr(tokenizer, f"{name}_token_id", None)
        if token_id is not None and hasattr(base, f"{name}_token_id"):
            values[f"{name}_token_id"] = token_id
    try:
        return AutoConfig.for_model(model_type, **values), ignored
    except (ValueError, TypeError) as e:
        raise ConfigError(f"the shape keys do not make a {model_type} model: {e}") from None


def _write(folder: str, family, model_type: str, shape: dict, seed: int) -> None:
    import torch
    import transformers
    tokenizer = family.default_tokenizer()
    config, ignored = hf_config_of(family, model_type, shape, tokenizer)
    auto = getattr(transformers, family.random_init_class)
    try:
        with torch.device("meta"):              # the size first, without allocating it
            parameters = sum(p.numel() for p in auto.from_config(config).parameters())
    except (ValueError, RuntimeError, AssertionError) as e:
        raise ConfigError(f"the shape keys do not make a {model_type} model: {e}") from None
    _check_memory(model_type, parameters)
    torch.manual_seed(seed)
    model = auto.from_config(config)            # transformers' own init, from the seed
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    summary = ", ".join(f"{k} {getattr(config, k)}" for k in SHAPE_KEYS if k not in ignored and
                        (k in shape or k in ("hidden_size", "num_hidden_layers", "vocab_size")))
    with open(os.path.join(folder, INFO), "w", encoding="utf-8") as f:
        json.dump({"model_type": model_type, "shape": shape, "seed": seed, "summary": summary,
                   "parameters": parameters, "tokenizer": family.default_tokenizer_name,
                   "ignored": ignored}, f, indent=1)


def _check_memory(model_type: str, parameters: int) -> None:
    """Building holds the model and writes it: refuse what cannot fit instead of swapping for hours."""
    need = 2 * 4 * parameters                   # fp32 weights, plus the copy saving makes
    free = _available_memory()
    if free is not None and need > free:
        raise ConfigError(f"a random {model_type} model of this shape has {parameters / 1e9:.2f}B "
                          f"parameters: building it needs about {need / 2**30:.1f} GiB, this machine has "
                          f"{free / 2**30:.1f} GiB free; lower hidden_size / num_hidden_layers, or give model_path")


def _available_memory() -> int | None:
    """Bytes the kernel could give without swapping (MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
