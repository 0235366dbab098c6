"""load_config: a JSON file -> a checked GalaxyConfig, every problem reported at once.

Keys starting with "_" (e.g. "_comment") are ignored, since JSON has no comments. Galaxy-LM's keys
are translated first (galaxy.compat.galaxy_lm): renamed ones are mapped, ones with no meaning here
dropped, and both listed in the config's notes, which the entry script prints.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import os

from galaxy.compat import galaxy_lm
from galaxy.config.checks import key_problems
from galaxy.config.errors import ConfigError, raise_all
from galaxy.config.keys import SHAPE_KEYS, GalaxyConfig
from galaxy.config.paths import resolve_paths
from galaxy.config.schema import declared, parse, show

# Every declared key -> (its field, its type).
DECLARED = {f.name: (f, typ) for f, typ in declared(GalaxyConfig)}


def load_config(path) -> GalaxyConfig:
    """Read and check a JSON config file. Relative paths in it resolve against the current
    directory (like paths on a command line), not the file's folder, and are stored absolute.

    Raises one ConfigError listing every problem the keys have (types, ranges, paths, shape);
    world-dependent checks are galaxy.config.world's.
    """
    path = os.fspath(path)
    raw = {k: v for k, v in read_json_object(path).items() if not k.startswith("_")}   # "_": comments
    found = galaxy_lm.translate(raw)
    problems, values = list(found.problems), {}
    for name, value in found.values.items():
        if name not in DECLARED:
            close = difflib.get_close_matches(name, [*DECLARED, *galaxy_lm.KEYS], n=1)
            hint = f"did you mean '{close[0]}'?" if close else "valid keys: " + ", ".join(DECLARED)
            problems.append(f"unknown key '{name}'; {hint}")
            continue
        f, typ = DECLARED[name]
        try:
            values[name] = parse(name, value, typ, f.metadata)
        except ConfigError as e:
            problems += e.problems
    if values.get("model_path") is None and not any(values.get(k) is not None for k in ("model_type", *SHAPE_KEYS)):
        problems.append("model_path is required: the folder of the pretrained model (with config.json); "
                        "or give model_type and shape keys (hidden_size, num_hidden_layers, ...) for a "
                        "randomly initialised model")
    notes = ["Galaxy-LM keys: " + "; ".join(found.mapped)] if found.mapped else []
    cfg = GalaxyConfig(**values, _given=frozenset(values), _notes=tuple(notes))
    problems += key_problems(cfg)
    problems += resolve_paths(cfg)
    shape_problems, shape_ignored = shape_key_problems(cfg)
    problems += shape_problems
    raise_all(problems)
    ignored = [*found.ignored, *shape_ignored]
    if shape_ignored:       # dropped: they describe no setting of this model
        cfg = dataclasses.replace(cfg, **{k: None for k in shape_ignored})
    return dataclasses.replace(cfg, _ignored=tuple(ignored))


def read_json_object(path: str) -> dict:
    """A config file's JSON object, or a one-line ConfigError saying why not."""
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
        raise ConfigError(f"config file {path!r} must hold a JSON object {{...}}, got {show(raw)}")
    return raw


def shape_key_problems(cfg: GalaxyConfig) -> tuple[list[str], list[str]]:
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
        return [], []     # resolve_paths or read_model_shape reports the folder
    problems, ignored = [], []
    for name in given:
        if name not in raw:
            ignored.append(name)
        elif raw[name] != getattr(cfg, name):
            problems.append(f"{name} is {show(getattr(cfg, name))} in the config but {show(raw[name])} in "
                            f"model_path's {path!r}; remove {name} (model_path decides the model) or "
                            f"make it agree")
    return problems, ignored
