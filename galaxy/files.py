"""Crash-safe file writing: a file (or folder) appears whole under its final name or not at all.

Everything is written under a temporary name, flushed to disk (fsync), then renamed: rename is
atomic on POSIX file systems, so a process killed at any moment leaves either the old file or
the new one, never a torn one. The parent folder is fsynced too, so the rename itself survives a
power cut.
"""
from __future__ import annotations

import json
import os

from safetensors.torch import save_file


def fsync_path(path: str) -> None:
    """Flush a file's or a folder's metadata and data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temp_name(path: str) -> str:
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}.tmp-{os.getpid()}")


def replace_with(temp: str, path: str) -> None:
    """Rename a complete, fsynced temp file or folder onto `path`, durably."""
    os.replace(temp, path)
    fsync_path(os.path.dirname(os.path.abspath(path)))


def write_text_atomic(path: str, text: str) -> None:
    temp = _temp_name(path)
    with open(temp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    replace_with(temp, path)


def write_json_atomic(path: str, value) -> None:
    write_text_atomic(path, json.dumps(value, indent=1) + "\n")


def write_safetensors_atomic(path: str, tensors: dict, metadata: dict | None = None) -> None:
    """safetensors file with tensor names as given; tensors must be contiguous CPU tensors."""
    temp = _temp_name(path)
    save_file(tensors, temp, metadata={"format": "pt", **(metadata or {})})
    # safetensors creates files private (0600); give them the permissions open() would.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(temp, 0o666 & ~umask)
    fsync_path(temp)
    replace_with(temp, path)
