"""Typed run configuration for the Galaxy scripts, loaded from JSON and checked up front.

    keys.py      every key, declared once in sections (type, default, range, doc)
    schema.py    how a declaration parses and checks a JSON value
    load.py      load_config: JSON -> GalaxyConfig, Galaxy-LM's keys translated, all problems at once
    checks.py    the rules that tie keys together (PEFT flags, checkpoints, the plan's keys)
    paths.py     paths made absolute and checked; checkpoint folder names
    world.py     validate_for_world and resolved_plan: the checks that need the world and the model
    presets.py   what each entry script fixes
    reference.py the key reference in docs/configuration.md, generated from the declarations

Every problem is a ConfigError whose lines each name the offending key (or argument) and what
would be valid, so an entry script prints them and exits 2 before any process group starts.
Importing this package needs no torch.
"""
from galaxy.config.checks import peft_method
from galaxy.config.errors import ConfigError
from galaxy.config.keys import PEFT_FLAGS, SHAPE_KEYS, GalaxyConfig, choices, with_plan
from galaxy.config.load import load_config
from galaxy.config.presets import apply_preset
from galaxy.config.schema import is_int, show
from galaxy.config.world import resolved_plan, validate_for_world

__all__ = ["ConfigError", "GalaxyConfig", "PEFT_FLAGS", "SHAPE_KEYS", "apply_preset", "choices", "is_int",
           "load_config", "peft_method", "resolved_plan", "show", "validate_for_world", "with_plan"]
