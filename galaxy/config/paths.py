"""The config's paths: made absolute (relative ones resolve against the current directory, like
paths on a command line, NOT against the config file's folder) and checked where they must exist;
and the naming of checkpoint folders (save_dir/step-00000120, written step-120 by users).

Each path key declares its rule (galaxy.config.keys, `path=`):
    folder_in    a model folder holding config.json (model_path)
    read         a file or folder that must exist (train_path, dev_path, test_path)
    folder       written later, need not exist (save_dir, export_dir, metrics_file)
    adapter      a peft adapter folder holding adapter_config.json (lora_path)
    checkpoint   a checkpoint folder, save_dir/step-N or a save_dir; "latest" is kept (resume)
class_list may name a text file, read here into the list of its lines.
"""
from __future__ import annotations

import os
import re

from galaxy.config.schema import declared

STEP_DIR = re.compile(r"^step-(\d+)$")


def step_dir_name(step: int) -> str:
    """A checkpoint's folder name: zero-padded, so that checkpoints sort by name."""
    return f"step-{step:08d}"


def resolve_paths(cfg) -> list[str]:
    """Make cfg's paths absolute and check the ones that must exist; every problem, one line each."""
    where = f"(relative paths are resolved from the current directory {os.getcwd()!r})"
    problems = []
    for f, _ in declared(type(cfg)):
        rule, value = f.metadata.get("path"), getattr(cfg, f.name)
        if rule is None or value is None or (rule == "checkpoint" and value == "latest"):
            continue
        path = os.path.abspath(value)
        if rule == "checkpoint":
            path = checkpoint_folder(path)
        problem = _PROBLEMS[rule](f.name, path, where)
        if problem:
            problems.append(problem)
        setattr(cfg, f.name, path)
    return problems + _read_class_list(cfg, where)


def _folder_in(name: str, path: str, where: str) -> str | None:
    if not os.path.isdir(path):
        return f"{name} {path!r} is not a directory; give a model folder holding config.json {where}"
    if not os.path.isfile(os.path.join(path, "config.json")):
        return f"{name} {path!r} has no config.json; give a Hugging Face model folder"
    return None


def _read(name: str, path: str, where: str) -> str | None:
    return None if os.path.exists(path) else f"{name} {path!r} does not exist; fix the path or remove the key {where}"


def _adapter(name: str, path: str, where: str) -> str | None:
    if os.path.isfile(os.path.join(path, "adapter_config.json")):
        return None
    return f"{name} {path!r} has no adapter_config.json; give a peft adapter folder {where}"


def _checkpoint(name: str, path: str, where: str) -> str | None:
    if os.path.isdir(path):
        return None
    return (f"{name} {path!r} is not a folder; give a checkpoint folder (save_dir/step-N), a save_dir, "
            f"or \"latest\" {where}{steps_in(path)}")


_PROBLEMS = {"folder_in": _folder_in, "read": _read, "folder": lambda *_: None, "adapter": _adapter,
             "checkpoint": _checkpoint}


def _read_class_list(cfg, where: str) -> list[str]:
    problems = []
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


def checkpoint_folder(path: str) -> str:
    """save_dir/step-4 names the folder save_dir/step-00000004 (users write the step as a number)."""
    m = STEP_DIR.match(os.path.basename(path))
    if os.path.isdir(path) or not m:
        return path
    padded = os.path.join(os.path.dirname(path), step_dir_name(int(m.group(1))))
    return padded if os.path.isdir(padded) else path


def steps_in(path: str) -> str:
    """'; <parent> holds step-2, step-4' when a missing step folder's parent holds others."""
    parent = os.path.dirname(path)
    steps = sorted(int(m.group(1)) for m in map(STEP_DIR.match, os.listdir(parent)) if m) \
        if STEP_DIR.match(os.path.basename(path)) and os.path.isdir(parent) else []
    return f"; {parent} holds " + ", ".join(f"step-{n}" for n in steps) if steps else ""
