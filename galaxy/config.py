"""Typed run configuration for the Galaxy scripts, loaded from JSON and checked up front.

Every problem is raised as a ConfigError whose message is one line naming the offending
key (or command-line argument) and what would be valid, so an entry script can print it
and exit before any process group starts: a mistake should cost one failed launch, not a
hung rendezvous or a crash ten minutes into training.

Relative paths in the JSON (model_path, train_path, dev_path, test_path, class_list,
metrics_file, save_dir, export_dir, resume) are resolved against the current working directory, like paths given on a
command line, NOT against the config file's folder. They are stored absolute.

Keys starting with "_" (e.g. "_comment") are ignored, since JSON has no comments. Galaxy-LM's
keys are translated first (galaxy.compat.galaxy_lm): renamed ones are mapped, ones with no meaning
here are dropped, and both are listed in the config's notes, which the entry script prints.

load_config and validate_for_world report every problem they find in one ConfigError, one line
per problem (the first line is the first problem), so a config with several mistakes costs one
failed launch, not one per mistake.

This module reads the model's config.json with `json` only, so importing it is cheap
and needs no torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
from dataclasses import dataclass, field

from galaxy.compat import galaxy_lm


class ConfigError(ValueError):
    """Bad config values or arguments: one line per problem, each naming the key.

    ConfigError(problem, *more): `problems` holds the lines; str() joins them with newlines.
    """

    def __init__(self, message: str, *more: str):
        # Entry scripts print exactly one line per problem, so never let a newline into one.
        self.problems = [" ".join(str(m).splitlines()) for m in (message, *more)]
        super().__init__("\n".join(self.problems))


def _raise_all(problems: list[str]) -> None:
    if problems:
        raise ConfigError(*problems)


# The names a few keys take: the one list of each, which the code that acts on them reads too.
PLAN_METHODS = {"att": ("TP", "SP"), "mlp": ("TP", "SP"), "con": ("SP", "None")}
PIPELINE_SCHEDULES = ("gpipe", "1f1b")
# dp_sharding: replicas hold whole copies (DDP), or FSDP2 shards them and frees each layer's
# gathered parameters after its forward ("full", ZeRO-3 like) or keeps them to backward ("no_reshard").
DP_SHARDING = ("none", "full", "no_reshard")
COMM_WAITS = ("auto", "poll", "block")   # galaxy.distributed.waiting
CPU_ALLOCATORS = ("keep", "system")      # galaxy.runtime.cpu_allocator
# PEFT method flags -> galaxy.peft's method names; at most one flag true, none means full.
PEFT_FLAGS = {"full_model": "full", "use_lora": "lora", "use_adapter": "adapter", "use_side": "side",
              "use_side_only": "side_only"}


# Model shape keys: without model_path they describe a randomly initialised model of model_type
# (galaxy.models.random_init); with it they must agree with its config.json.
SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "num_hidden_layers", "vocab_size", "type_vocab_size", "max_position_embeddings")
TASKS = ("classification", "causal_lm")


@dataclass
class GalaxyConfig:
    model_path: str | None = None  # None: a random model of model_type and the shape keys
    train_path: str | None = None  # None: the embedded default dataset
    dev_path: str | None = None
    test_path: str | None = None
    class_list: list[str] | None = None  # a file name in the JSON is read into a list
    pad_size: int = 128
    batch_size: int = 8
    learning_rate: float = 5e-5
    num_epochs: int = 1
    max_steps: int | None = None
    optimizer: str = "adamw"
    weight_decay: float = 0.0
    shuffle: bool = True
    seed: int = 42
    metrics_file: str | None = None
    att_parallel_method: str = "TP"
    mlp_parallel_method: str = "TP"
    con_parallel_method: str = "SP"  # JSON null is stored as the string "None"
    tp_num_attention_heads_list: list[int] | None = None
    tp_intermediate_size_list: list[int] | None = None
    seq_scatter_list: list[int] | None = None
    distributed_backend: str | None = None  # None: nccl when CUDA is available, else gloo
    timeout_s: float = 120.0
    pp_deg: int = 1
    dp_deg: int = 1
    dp_sharding: str = "none"  # "full" | "no_reshard": shard the dp_deg replicas (FSDP2); needs dp_deg > 1
    # Pipeline (pp_deg > 1): layers per stage (None: even split), micro-batches per step, schedule.
    stage_num_hidden_layers_list: list[int] | None = None
    num_microbatches: int = 1
    # Activation checkpointing: "none", "full", a number of leading layers, or layer indices.
    activation_checkpointing: str | int | list[int] = "none"
    pipeline_schedule: str = "1f1b"
    dropout: float | None = None  # None: keep the model config's dropout probabilities
    # Training loop (galaxy/train): schedule, clipping, accumulation, precision, eval, checkpoints.
    lr_schedule: str = "constant"  # constant | linear | cosine, after warmup_steps of linear warm-up
    warmup_steps: int = 0
    clip_grad: float | None = None  # max global gradient norm; None: no clipping
    grad_accum_steps: int = 1  # micro-batches per optimizer step; batch_size stays the global batch
    # A TP ATT's and MLP's collectives travel in this many chunks of the sequence, overlapped with
    # the GEMMs (galaxy.layers.block); 1: one collective per transition.
    comm_chunks: int = 1
    # An SP ATT attends to its own tokens' keys while the other ranks' K/V are all-gathered, and to
    # theirs after (galaxy.layers.attention_blocks): pays on a slow link, costs a little on a fast one.
    kv_blocks: bool = False
    # How a rank waits for CPU collectives (galaxy.distributed.waiting): poll them, yielding the
    # core, or block; auto polls on gloo when every rank on the host has a core of its own.
    comm_wait: str = "auto"
    # CPU runs: "keep" makes glibc keep freed memory mapped, so a step's big tensors (a word
    # embedding's gradient) reuse pages instead of faulting fresh ones in every step
    # (galaxy.runtime.cpu_allocator); "system" leaves the C allocator as it is.
    cpu_allocator: str = "keep"
    mixed_precision: str = "none"  # "bf16": autocast the forward pass; JSON null is stored as "none"
    eval_interval: int | None = None  # None: evaluate the dev set at the end only
    save_dir: str | None = None  # None: no checkpoints
    save_interval: int | None = None  # None: save at the end of training only
    keep_checkpoints: int | None = None  # None: keep all; else the newest N
    # Parameter-efficient fine-tuning (galaxy/peft): at most one method flag true; none = full.
    full_model: bool = False
    use_lora: bool = False
    use_adapter: bool = False
    use_side: bool = False
    use_side_only: bool = False
    lora_dim: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_target_modules: list[str] | None = None   # None: the query and value projections
    lora_path: str | None = None                   # a peft adapter directory to start from
    merge_lora: bool = False                       # export merged weights instead of an adapter
    adapter_reduction_dim: int = 64
    non_linearity: str = "relu"
    side_reduction_factor: int = 8
    resume: str | None = None  # "latest" (in save_dir) or a checkpoint folder
    export_dir: str | None = None  # Hugging Face folder written at the end of training
    # A classifier head in model_path sized for another label set: start a new one (HF's option).
    ignore_mismatched_sizes: bool = False
    task: str | None = None  # classification | causal_lm; None: the entry script's task
    model_type: str | None = None  # the family of a random model; must match model_path's
    hidden_size: int | None = None  # the shape keys (SHAPE_KEYS)
    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    num_hidden_layers: int | None = None
    vocab_size: int | None = None
    type_vocab_size: int | None = None
    max_position_embeddings: int | None = None
    init_method: str | None = None  # the default of --init_method (Galaxy-LM kept it here)
    max_eval_samples: int | None = None  # evaluate only the first N dev / test examples
    # Set by apply_preset, not read from JSON: which entry script runs this config.
    preset: str = "galaxy"
    # Keys the JSON set explicitly, so a preset can tell "left at default" from "asked for".
    _given: frozenset = field(default=frozenset(), repr=False, compare=False)
    _script: str | None = field(default=None, repr=False, compare=False)
    # What loading did that the user should hear about (rank 0 prints them): note lines, and the
    # keys dropped for having no meaning here (printed as one warning line).
    _notes: tuple = field(default=(), repr=False, compare=False)
    _ignored: tuple = field(default=(), repr=False, compare=False)


# Key -> (expected kind, null allowed). A tuple kind is an enum of valid strings.
_SPEC: dict[str, tuple[object, bool]] = {
    "model_path": (str, True),
    "train_path": (str, True),
    "dev_path": (str, True),
    "test_path": (str, True),
    "class_list": ("classes", True),
    "pad_size": (int, False),
    "batch_size": (int, False),
    "learning_rate": (float, False),
    "num_epochs": (int, False),
    "max_steps": (int, True),
    "optimizer": (("sgd", "adamw"), False),
    "weight_decay": (float, False),
    "shuffle": (bool, False),
    "seed": (int, False),
    "metrics_file": (str, True),
    "att_parallel_method": (PLAN_METHODS["att"], False),
    "mlp_parallel_method": (PLAN_METHODS["mlp"], False),
    "con_parallel_method": (PLAN_METHODS["con"], True),
    "tp_num_attention_heads_list": ("int_list", True),
    "tp_intermediate_size_list": ("int_list", True),
    "seq_scatter_list": ("int_list", True),
    "distributed_backend": (("gloo", "nccl"), True),
    "timeout_s": (float, False),
    "pp_deg": (int, False),
    "dp_deg": (int, False),
    "dp_sharding": (DP_SHARDING, False),
    "stage_num_hidden_layers_list": ("int_list", True),
    "num_microbatches": (int, False),
    "pipeline_schedule": (PIPELINE_SCHEDULES, False),
    "activation_checkpointing": ("layers", False),
    "dropout": (float, True),
    "lr_schedule": (("constant", "linear", "cosine"), False),
    "warmup_steps": (int, False),
    "clip_grad": (float, True),
    "grad_accum_steps": (int, False),
    "comm_chunks": (int, False),
    "kv_blocks": (bool, False),
    "comm_wait": (COMM_WAITS, False),
    "cpu_allocator": (CPU_ALLOCATORS, False),
    "mixed_precision": (("bf16", "none"), True),
    "eval_interval": (int, True),
    "save_dir": (str, True),
    "save_interval": (int, True),
    "keep_checkpoints": (int, True),
    "resume": (str, True),
    "export_dir": (str, True),
    "ignore_mismatched_sizes": (bool, False),
    "full_model": (bool, False),
    "use_lora": (bool, False),
    "use_adapter": (bool, False),
    "use_side": (bool, False),
    "use_side_only": (bool, False),
    "lora_dim": (int, False),
    "lora_alpha": (float, False),
    "lora_dropout": (float, False),
    "lora_target_modules": ("str_list", True),
    "lora_path": (str, True),
    "merge_lora": (bool, False),
    "adapter_reduction_dim": (int, False),
    "non_linearity": (str, False),
    "side_reduction_factor": (int, False),
    "task": (TASKS, True),
    "model_type": (str, True),
    **{key: (int, True) for key in SHAPE_KEYS},
    "init_method": (str, True),
    "max_eval_samples": (int, True),
}
_POSITIVE_INTS = ("pad_size", "batch_size", "num_epochs", "max_steps", "pp_deg", "dp_deg", "num_microbatches",
                  "grad_accum_steps", "comm_chunks", "eval_interval", "save_interval", "keep_checkpoints",
                  "lora_dim", "adapter_reduction_dim", "side_reduction_factor", "max_eval_samples", *SHAPE_KEYS)
_SPLIT_KEYS = ("tp_num_attention_heads_list", "tp_intermediate_size_list", "seq_scatter_list")
_KIND_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "true or false",
               "int_list": "a list of integers", "str_list": "a list of strings",
               "classes": "a list of strings or the path of a text file",
               "layers": '"none", "full", a number of leading layers or a list of layer indices'}


def _show(value) -> str:
    """A JSON value as the user wrote it, with its JSON type, kept short for one line."""
    text = json.dumps(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    kind = {bool: "boolean", int: "integer", float: "number", str: "string", list: "list",
            dict: "object", type(None): "null"}.get(type(value), type(value).__name__)
    return f"{text} ({kind})"


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # true/false are not counts


def _check_type(key: str, value):
    """Return the value converted to its field type, or raise ConfigError."""
    kind, nullable = _SPEC[key]
    if value is None:
        if key == "con_parallel_method":
            return "None"
        if key == "mixed_precision":
            return "none"
        if nullable:
            return None
    elif isinstance(kind, tuple):
        if value in kind:
            return value
        valid = ", ".join(f"'{k}'" for k in kind) + (" or null" if nullable else "")
        raise ConfigError(f"{key} must be one of {valid}, got {_show(value)}")
    elif kind is int and _is_int(value):
        return value
    elif kind is float and (_is_int(value) or isinstance(value, float)):
        if not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number, got {value}")
        return float(value)
    elif kind is str and isinstance(value, str):
        return value
    elif kind is bool and isinstance(value, bool):
        return value
    elif kind == "int_list" and isinstance(value, list):
        for i, item in enumerate(value):
            if not _is_int(item):
                raise ConfigError(f"{key}[{i}] must be an integer, got {_show(item)}")
        return list(value)
    elif kind == "str_list" and isinstance(value, list):
        for i, item in enumerate(value):
            if not isinstance(item, str):
                raise ConfigError(f"{key}[{i}] must be a string, got {_show(item)}")
        return list(value)
    elif kind == "layers" and (value in ("none", "full") or _is_int(value) or isinstance(value, list)):
        for i, item in enumerate(value if isinstance(value, list) else []):
            if not _is_int(item):
                raise ConfigError(f"{key}[{i}] must be a layer index (an integer), got {_show(item)}")
        return value
    elif kind == "classes" and (isinstance(value, str) or isinstance(value, list)):
        for i, item in enumerate(value if isinstance(value, list) else []):
            if not isinstance(item, str):
                raise ConfigError(f"{key}[{i}] must be a string, got {_show(item)}")
        return value
    expected = _KIND_NAMES[kind] + (" or null" if nullable else "")
    raise ConfigError(f"{key} must be {expected}, got {_show(value)}")


def _check_ranges(cfg: GalaxyConfig) -> list[str]:
    """Every out-of-range value, one line each."""
    problems = []
    for key in _POSITIVE_INTS:
        value = getattr(cfg, key)
        if value is not None and value < 1:
            problems.append(f"{key} must be at least 1, got {value}")
    if cfg.seed < 0:
        problems.append(f"seed must be 0 or more, got {cfg.seed}")
    if cfg.learning_rate <= 0:
        problems.append(f"learning_rate must be greater than 0, got {cfg.learning_rate}")
    if cfg.weight_decay < 0:
        problems.append(f"weight_decay must be 0 or more, got {cfg.weight_decay}")
    if cfg.timeout_s <= 0:
        problems.append(f"timeout_s must be greater than 0 seconds, got {cfg.timeout_s}")
    try:
        peft_method(cfg)
    except ConfigError as e:
        problems += e.problems
    if not 0 <= cfg.lora_dropout < 1:
        problems.append(f"lora_dropout must be in [0, 1), got {cfg.lora_dropout}")
    if cfg.dropout is not None and not 0 <= cfg.dropout < 1:
        problems.append(f"dropout must be in [0, 1) or null, got {cfg.dropout}")
    if cfg.init_method is not None and not cfg.init_method.startswith(("tcp://", "file://", "env://")):
        problems.append(f"init_method {cfg.init_method} must start with tcp://, file:// or env://")
    problems += _check_training_keys(cfg)
    for key in _SPLIT_KEYS:
        values = getattr(cfg, key)
        if values is not None and not values:
            problems.append(f"{key} must not be empty; give one entry per rank or remove the key")
        for i, v in enumerate(values or []):
            if v < 1:
                problems.append(f"{key}[{i}] must be at least 1 (every rank needs a share), got {v}")
    return problems


def peft_method(cfg) -> str:
    """The PEFT method the flags select (galaxy.peft's name for it); ConfigError unless at most
    one flag is true. None true means full fine-tuning, unless the config set full_model to
    false explicitly (it is in cfg._given): then it asked for no method at all."""
    on = [flag for flag in PEFT_FLAGS if getattr(cfg, flag, False)]
    if len(on) > 1 or (not on and "full_model" in getattr(cfg, "_given", ())):
        got = " and ".join(on) + (" are all true" if on else "full_model is false and no other is true")
        raise ConfigError(f"{got}; set exactly one of {', '.join(PEFT_FLAGS)} to true")
    return PEFT_FLAGS[on[0]] if on else "full"


def _check_training_keys(cfg: GalaxyConfig) -> list[str]:
    problems = []
    if cfg.warmup_steps < 0:
        problems.append(f"warmup_steps must be 0 or more, got {cfg.warmup_steps}")
    if cfg.clip_grad is not None and cfg.clip_grad <= 0:
        problems.append(f"clip_grad must be greater than 0 or null (no clipping), got {cfg.clip_grad}")
    if cfg.grad_accum_steps >= 1 and cfg.batch_size % cfg.grad_accum_steps:
        problems.append(f"batch_size {cfg.batch_size} is not divisible by grad_accum_steps "
                        f"{cfg.grad_accum_steps}; batch_size is the global batch of one optimizer "
                        f"step, split into grad_accum_steps equal micro-batches")
    for key in ("save_interval", "keep_checkpoints"):
        if getattr(cfg, key) is not None and cfg.save_dir is None:
            problems.append(f"{key} is set but save_dir is not; add save_dir or remove {key}")
    if cfg.resume == "latest" and cfg.save_dir is None:
        problems.append('resume is "latest" but save_dir is not set; add save_dir (the folder '
                        'the checkpoints are in) or give resume a checkpoint folder')
    return problems


def _resolve_paths(cfg: GalaxyConfig) -> list[str]:
    """Make the paths absolute and check the ones that must exist; every problem, one line each."""
    where = f"(relative paths are resolved from the current directory {os.getcwd()!r})"
    problems = []
    if cfg.model_path is not None:
        model = os.path.abspath(cfg.model_path)
        if not os.path.isdir(model):
            problems.append(f"model_path {model!r} is not a directory; give a model folder "
                            f"holding config.json {where}")
        elif not os.path.isfile(os.path.join(model, "config.json")):
            problems.append(f"model_path {model!r} has no config.json; give a Hugging Face model folder")
        cfg.model_path = model
    for key in ("train_path", "dev_path", "test_path"):
        value = getattr(cfg, key)
        if value is not None:
            path = os.path.abspath(value)
            if not os.path.exists(path):
                problems.append(f"{key} {path!r} does not exist; fix the path or remove the key "
                                f"{where}")
            setattr(cfg, key, path)
    for key in ("metrics_file", "save_dir", "export_dir"):
        if getattr(cfg, key) is not None:  # written later, need not exist
            setattr(cfg, key, os.path.abspath(getattr(cfg, key)))
    if cfg.lora_path is not None:
        path = os.path.abspath(cfg.lora_path)
        if not os.path.isfile(os.path.join(path, "adapter_config.json")):
            problems.append(f"lora_path {path!r} has no adapter_config.json; give a peft adapter "
                            f"folder {where}")
        cfg.lora_path = path
    if cfg.resume not in (None, "latest"):
        path = _checkpoint_folder(os.path.abspath(cfg.resume))
        if not os.path.isdir(path):
            problems.append(f"resume {path!r} is not a folder; give a checkpoint folder (save_dir/"
                            f"step-N), a save_dir, or \"latest\" {where}{_steps_in(path)}")
        cfg.resume = path
    if isinstance(cfg.class_list, str):
        path = os.path.abspath(cfg.class_list)
        try:
            with open(path, encoding="utf-8") as f:
                cfg.class_list = [line.strip() for line in f if line.strip()]
        except OSError as e:
            cfg.class_list = None
            problems.append(f"class_list file {path!r} cannot be read ({e.strerror}); give a "
                            f"text file with one label per line or a JSON list {where}")
    if cfg.class_list is not None:
        if not cfg.class_list:
            problems.append("class_list is empty; give at least one label name")
        dupes = sorted({c for c in cfg.class_list if cfg.class_list.count(c) > 1})
        if dupes:
            problems.append(f"class_list names {dupes[0]!r} more than once; label names must be unique")
    return problems


_STEP_NAME = re.compile(r"^step-(\d+)$")


def _checkpoint_folder(path: str) -> str:
    """save_dir/step-4 names the folder save_dir/step-00000004 (checkpoints are zero-padded so
    that they sort by name; users write the step as a number)."""
    m = _STEP_NAME.match(os.path.basename(path))
    if os.path.isdir(path) or not m:
        return path
    padded = os.path.join(os.path.dirname(path), f"step-{int(m.group(1)):08d}")
    return padded if os.path.isdir(padded) else path


def _steps_in(path: str) -> str:
    """'; <parent> holds step-2, step-4' when a missing step folder's parent holds others."""
    parent = os.path.dirname(path)
    steps = sorted(int(m.group(1)) for m in map(_STEP_NAME.match, os.listdir(parent)) if m) \
        if _STEP_NAME.match(os.path.basename(path)) and os.path.isdir(parent) else []
    return f"; {parent} holds " + ", ".join(f"step-{n}" for n in steps) if steps else ""


def _check_shape_keys(cfg: GalaxyConfig) -> tuple[list[str], list[str]]:
    """(problems, keys to ignore): model_type and the shape keys against model_path's config.json.

    A key the folder's config.json does not have (BERT's type_vocab_size given for a Llama) has
    no meaning for that model: it is ignored, with the warning. Without model_path the random
    model's builder checks them (galaxy.models.random_init).
    """
    given = [k for k in ("model_type", *SHAPE_KEYS) if getattr(cfg, k) is not None]
    if cfg.model_path is None or not given:
        return [], []
    path = os.path.join(cfg.model_path, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return [], []     # _resolve_paths or read_model_shape reports the folder
    problems, ignored = [], []
    for key in given:
        if key not in raw:
            ignored.append(key)
        elif raw[key] != getattr(cfg, key):
            problems.append(f"{key} is {_show(getattr(cfg, key))} in the config but {_show(raw[key])} in "
                            f"model_path's {path!r}; remove {key} (model_path decides the model) or "
                            f"make it agree")
    return problems, ignored


def _read_raw(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path!r} cannot be read: {e}") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"config file {path!r} is not valid JSON: {e.msg} at line {e.lineno} "
                          f"column {e.colno}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path!r} must hold a JSON object {{...}}, got {_show(raw)}")
    return raw


def load_config(path) -> GalaxyConfig:
    """Read and check a JSON config file (see the module docstring for path rules).

    Raises one ConfigError listing every problem the keys have (types, ranges, paths, shape);
    world-dependent checks are validate_for_world's.
    """
    path = os.fspath(path)
    raw = {k: v for k, v in _read_raw(path).items() if not k.startswith("_")}   # "_": comments
    found = galaxy_lm.translate(raw)
    problems, values = list(found.problems), {}
    for key, value in found.values.items():
        if key not in _SPEC:
            close = difflib.get_close_matches(key, [*_SPEC, *galaxy_lm.KEYS], n=1)
            hint = f"did you mean '{close[0]}'?" if close else "valid keys: " + ", ".join(_SPEC)
            problems.append(f"unknown key '{key}'; {hint}")
            continue
        try:
            values[key] = _check_type(key, value)
        except ConfigError as e:
            problems += e.problems
    if values.get("model_path") is None and not any(values.get(k) is not None for k in ("model_type", *SHAPE_KEYS)):
        problems.append("model_path is required: the folder of the pretrained model (with config.json); "
                        "or give model_type and shape keys (hidden_size, num_hidden_layers, ...) for a "
                        "randomly initialised model")
    notes = ["Galaxy-LM keys: " + "; ".join(found.mapped)] if found.mapped else []
    cfg = GalaxyConfig(**values, _given=frozenset(values), _notes=tuple(notes))
    problems += _check_ranges(cfg)
    problems += _resolve_paths(cfg)
    shape_problems, shape_ignored = _check_shape_keys(cfg)
    problems += shape_problems
    _raise_all(problems)
    ignored = [*found.ignored, *shape_ignored]
    if shape_ignored:       # dropped: they describe no setting of this model
        cfg = dataclasses.replace(cfg, **{k: None for k in shape_ignored})
    return dataclasses.replace(cfg, _ignored=tuple(ignored))


def even_split(total: int, parts: int, unit: int = 1) -> list[int]:
    """Split total into parts multiples of unit that differ by at most one unit, larger first.

    even_split(12, 5) == [3, 3, 2, 2, 2]; even_split(8, 2, unit=2) == [4, 4].
    Raises ValueError when some part would be 0 or total is not a multiple of unit.
    """
    if parts < 1 or unit < 1:
        raise ValueError(f"parts and unit must be at least 1, got parts={parts} unit={unit}")
    if total % unit:
        raise ValueError(f"{total} is not a multiple of {unit}")
    units = total // unit
    if units < parts:
        raise ValueError(f"{units} units of {unit} cannot fill {parts} parts")
    base, extra = divmod(units, parts)
    return [(base + (i < extra)) * unit for i in range(parts)]


def resolve_splits(cfg: GalaxyConfig, group_size: int, shape: dict) -> dict:
    """Concrete per-rank split lists, keyed like the config keys.

    A list given in the config is checked (length == group_size, right sum, whole KV groups
    for attention TP) and returned as is; an omitted one becomes even_split(...). A split
    the chosen methods do not use (heads when attention is SP, intermediate when MLP is SP,
    sequence when nothing is SP) is None if it cannot be made, instead of an error.
    Raises one ConfigError naming every bad list.
    """
    out, problems = _splits(cfg, group_size, shape)
    _raise_all(problems)
    return out


def _splits(cfg: GalaxyConfig, group_size: int, shape: dict) -> tuple[dict, list[str]]:
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    kv_group = heads // kv
    att_tp = cfg.att_parallel_method == "TP"
    uses_sp = "SP" in (cfg.att_parallel_method, cfg.mlp_parallel_method, cfg.con_parallel_method)
    cells = f"world {group_size * cfg.pp_deg * cfg.dp_deg} / (pp_deg {cfg.pp_deg} x dp_deg {cfg.dp_deg})"
    plans = {  # key -> (total, what the total is, unit for the default split, needed?, fix)
        "tp_num_attention_heads_list": (heads, "num_attention_heads in the model config",
                                        kv_group if att_tp else 1, att_tp,
                                        "or set att_parallel_method to 'SP'"),
        "tp_intermediate_size_list": (shape["intermediate_size"], "intermediate_size in the "
                                      "model config", 1, cfg.mlp_parallel_method == "TP",
                                      "or set mlp_parallel_method to 'SP'"),
        "seq_scatter_list": (cfg.pad_size, "pad_size", 1, uses_sp, "or raise pad_size"),
    }
    out, problems = {}, []
    for key, (total, what, unit, needed, fix) in plans.items():
        given = getattr(cfg, key)
        if given is not None:
            if len(given) != group_size:
                problems.append(f"{key} has {len(given)} entries but the Galaxy group has "
                                f"{group_size} ranks ({cells})")
            elif sum(given) != total:
                problems.append(f"{key} sums to {sum(given)} but {what} is {total}; make the "
                                f"entries add up to {total}")
            elif key == "tp_num_attention_heads_list" and att_tp and kv_group > 1:
                for i, v in enumerate(given):
                    if v % kv_group:
                        problems.append(
                            f"{key}[{i}] is {v}, not a multiple of {kv_group}: the model's "
                            f"{heads} query heads share {kv} KV heads, so each TP rank needs "
                            f"whole groups of {kv_group} heads")
                        break
            out[key] = list(given)
            continue
        try:
            out[key] = even_split(total, group_size, unit)
        except ValueError:
            if needed:
                units = f"{total // unit} KV groups" if unit > 1 else f"{total}"
                problems.append(
                    f"{key} is omitted and {what} ({units}) cannot be split over the "
                    f"{group_size} ranks of the Galaxy group ({cells}) without a rank getting "
                    f"none; use at most {total // unit} ranks per group {fix}")
            out[key] = None
    return out, problems


def validate_for_world(cfg: GalaxyConfig, world: int, rank: int, shape: dict) -> None:
    """Check that cfg can run as `rank` of `world` processes on a model of `shape`
    (galaxy.models.shape.read_model_shape); raises one ConfigError naming every problem found."""
    if world < 1:
        raise ConfigError(f"--world must be at least 1, got {world}")
    if not 0 <= rank < world:
        raise ConfigError(f"--rank {rank} is out of range for --world {world}; use 0..{world - 1}")
    if cfg.preset == "serial" and world != 1:
        who = cfg._script or "the serial preset"
        raise ConfigError(f"--world is {world} but {who} runs on one process; use --world 1 "
                          f"or a distributed script")
    problems = []
    cells = cfg.pp_deg * cfg.dp_deg
    if world % cells:
        problems.append(f"--world {world} is not divisible by pp_deg {cfg.pp_deg} x dp_deg "
                        f"{cfg.dp_deg} = {cells}; use a multiple of {cells} ranks or change "
                        f"pp_deg/dp_deg")
    if cfg.batch_size % cfg.dp_deg:
        problems.append(f"batch_size {cfg.batch_size} is not divisible by dp_deg {cfg.dp_deg}; "
                        f"use a multiple of {cfg.dp_deg}")
    problems += _pipeline_problems(cfg, shape)
    try:
        recompute_layers(cfg.activation_checkpointing, shape["num_hidden_layers"])
    except ConfigError as e:
        problems += e.problems
    if cfg.dp_sharding != "none" and cfg.dp_deg == 1:
        problems.append(f"dp_sharding is '{cfg.dp_sharding}' but dp_deg is 1: it shards the data-parallel "
                        f"replicas' parameters over dp_deg > 1 replicas; set dp_deg or remove dp_sharding")
    if cfg.pad_size > shape["max_position_embeddings"]:
        problems.append(f"pad_size {cfg.pad_size} exceeds the model's max_position_embeddings "
                        f"{shape['max_position_embeddings']}; lower pad_size")
    if not world % cells:
        problems += _splits(cfg, world // cells, shape)[1]
    _raise_all(problems)


def recompute_layers(spec, num_layers: int) -> frozenset[int]:
    """The layers activation checkpointing recomputes: spec "none", "full", a number of leading
    layers or a list of layer indices (config key activation_checkpointing)."""
    if spec == "none":
        return frozenset()
    if spec == "full":
        return frozenset(range(num_layers))
    if isinstance(spec, int):
        if not 0 <= spec <= num_layers:
            raise ConfigError(f"activation_checkpointing {spec} is not a number of layers of the model's "
                              f"{num_layers}; use 0..{num_layers}, \"full\" or a list of layer indices")
        return frozenset(range(spec))
    bad = [i for i in spec if not 0 <= i < num_layers]
    if bad:
        raise ConfigError(f"activation_checkpointing names layer {bad[0]}, but the model's layers are "
                          f"0..{num_layers - 1}; fix the list")
    return frozenset(spec)


def _pipeline_problems(cfg: GalaxyConfig, shape: dict) -> list[str]:
    layers, stages = shape["num_hidden_layers"], cfg.pp_deg
    given, problems = cfg.stage_num_hidden_layers_list, []
    if given is not None:
        if len(given) != stages:
            problems.append(f"stage_num_hidden_layers_list has {len(given)} entries but pp_deg is "
                            f"{stages}; give one layer count per stage")
        elif sum(given) != layers:
            problems.append(f"stage_num_hidden_layers_list sums to {sum(given)} but the model has "
                            f"{layers} layers; make the entries add up to {layers}")
        if given and min(given) < 1:
            problems.append("stage_num_hidden_layers_list entries must be at least 1")
    elif stages > layers:
        problems.append(f"pp_deg {stages} exceeds the model's {layers} layers; use at most {layers} stages")
    if stages > 1 and cfg.pipeline_schedule == "1f1b" and cfg.num_microbatches < stages:
        problems.append(f"num_microbatches is {cfg.num_microbatches} but the 1f1b schedule needs at least "
                        f"pp_deg = {stages}; raise num_microbatches (it must divide batch_size / dp_deg) "
                        f"or set pipeline_schedule to gpipe")
    if stages > 1 and cfg.grad_accum_steps > 1:
        problems.append("grad_accum_steps does not apply with pp_deg > 1 (the pipeline's "
                        "num_microbatches is its accumulation); remove it")
    if stages > 1 and (cfg.batch_size // cfg.dp_deg) % cfg.num_microbatches:
        problems.append(f"num_microbatches {cfg.num_microbatches} does not divide the "
                        f"{cfg.batch_size // cfg.dp_deg} rows per replica (batch_size / dp_deg); "
                        "choose a divisor")
    return problems


# Preset -> methods the entry script fixes. "serial" and "galaxy" fix none: serial runs one
# process (checked in validate_for_world), galaxy runs whatever the config says.
_PRESETS = {
    "serial": {},
    "tp": {"att_parallel_method": "TP", "con_parallel_method": "None", "mlp_parallel_method": "TP"},
    "sp": {"att_parallel_method": "SP", "con_parallel_method": "SP", "mlp_parallel_method": "SP"},
    "galaxy": {},
    "dp": {},
    "pp": {},
}
# pretrain_dp_bert.py / pretrain_pp_bert.py: every rank not claimed by the other axis is a data
# replica / a pipeline stage, unless the config gives the degree (then the rest is Galaxy groups).
_PRESET_FILLS = {"dp": ("dp_deg", "pp_deg"), "pp": ("pp_deg", "dp_deg")}


def apply_preset(cfg: GalaxyConfig, preset: str, script: str | None = None,
                 world: int | None = None) -> GalaxyConfig:
    """A copy of cfg with the parallel methods that the entry script `script` runs.

    For the dp / pp presets with `world` known, an omitted dp_deg / pp_deg becomes
    world // (the other degree).

    A method key the JSON set explicitly to something else is an error rather than being
    silently overridden: the user asked for a method this script does not run.
    """
    if preset not in _PRESETS:
        raise ConfigError(f"preset '{preset}' is unknown; valid presets: {', '.join(_PRESETS)}")
    who = script or f"the '{preset}' preset"
    _raise_all([f"{key} is '{getattr(cfg, key)}' but {who} runs {key[:3].upper()} {value}; remove the "
                f"key or use pretrain_galaxy.py"
                for key, value in _PRESETS[preset].items() if key in cfg._given and getattr(cfg, key) != value])
    fill = {}
    if preset in _PRESET_FILLS and world is not None:
        key, other = _PRESET_FILLS[preset]
        if key not in cfg._given:
            fill[key] = max(1, world // getattr(cfg, other))
    out = dataclasses.replace(cfg, **_PRESETS[preset], **fill, preset=preset, _script=script)
    if out.pp_deg > 1 and out.num_microbatches < out.pp_deg and "pipeline_schedule" not in cfg._given:
        # 1F1B keeps a micro-batch in flight per stage, so it needs at least pp_deg of them;
        # with fewer (Galaxy-LM's pipeline configs use 1) GPipe computes the same step.
        note = (f"num_microbatches {out.num_microbatches} < pp_deg {out.pp_deg}: pipeline_schedule "
                f"gpipe (1f1b needs at least pp_deg micro-batches)")
        out = dataclasses.replace(out, pipeline_schedule="gpipe", _notes=(*out._notes, note))
    return out
