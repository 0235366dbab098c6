"""Output paths checked before training: a run must not train for an hour and then find that it
cannot write its checkpoint or its export.

Nothing is created here (a check leaves no trace); a folder that does not exist yet is fine when
its nearest existing ancestor is a folder this user may write in.
"""
from __future__ import annotations

import os

from galaxy.config import ConfigError

# key -> what the run writes there
OUTPUTS = (("save_dir", "folder"), ("export_dir", "folder"), ("metrics_file", "file"))


def check_output_paths(cfg) -> None:
    for key, kind in OUTPUTS:
        path = getattr(cfg, key, None)
        if path is not None:
            check_writable(key, path, kind)
    export = getattr(cfg, "export_dir", None)
    if export is not None and os.path.realpath(export) == os.path.realpath(cfg.model_path):
        raise ConfigError(f"export_dir {export!r} is model_path: the export would overwrite the model it "
                          "starts from; give another folder")


def check_writable(key: str, path: str, kind: str) -> None:
    if os.path.exists(path):
        if kind == "folder" and not os.path.isdir(path):
            raise ConfigError(f"{key} {path!r} is an existing file, not a folder; give a folder path "
                              "(it is created if missing) or move the file away")
        if kind == "file" and os.path.isdir(path):
            raise ConfigError(f"{key} {path!r} is a folder; give the path of a file")
        where = path if kind == "folder" else os.path.dirname(path)
        if not os.access(where, os.W_OK | os.X_OK) or (kind == "file" and not os.access(path, os.W_OK)):
            raise ConfigError(f"{key} {path!r} is not writable by this user; fix its permissions or give "
                              "another path")
        return
    ancestor = os.path.dirname(path)
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise ConfigError(f"{key} {path!r} cannot be created: {ancestor!r} is a file, not a folder; "
                          f"give a path under a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ConfigError(f"{key} {path!r} cannot be created: no permission to write in {ancestor!r}; "
                          "give a path you can write to")
