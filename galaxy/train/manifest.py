"""A checkpoint's manifest: every file's size and SHA-256, written at save time, verified on resume.

    step-00000120/manifest.json   {"format": 1, "files": {"optimizer.safetensors": {"bytes": ..,
                                   "sha256": ..}, "model/model.safetensors": {...}, ...}}

The save writes it last, inside the temporary folder, so a complete checkpoint always has one. A
file truncated or changed afterwards (a full disk, a partial copy between machines, bit rot) is
then named on resume before any process group starts, and resume "latest" falls back to the
newest checkpoint that verifies (galaxy.train.checkpoint). Checkpoints saved before manifests
existed are checked by their safetensors headers only.
"""
from __future__ import annotations

import hashlib
import json
import os

from safetensors import SafetensorError, safe_open

from galaxy.files import write_json_atomic

MANIFEST = "manifest.json"
FORMAT = 1
_CHUNK = 1 << 20
# Files a checkpoint without a manifest is checked by (their headers and sizes).
_HEADER_CHECKED = ("optimizer.safetensors", "rng.safetensors", os.path.join("model", "model.safetensors"))


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files(folder: str) -> list[str]:
    """Every file under folder, relative, sorted; the manifest itself and hidden temporaries left out."""
    out = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), folder)
            if rel != MANIFEST and not name.startswith("."):
                out.append(rel)
    return sorted(out)


def write_manifest(folder: str) -> None:
    files = {rel: {"bytes": os.path.getsize(os.path.join(folder, rel)), "sha256": sha256_of(os.path.join(folder, rel))}
             for rel in _files(folder)}
    write_json_atomic(os.path.join(folder, MANIFEST), {"format": FORMAT, "files": files})


def verify(folder: str) -> str | None:
    """None when the checkpoint folder is whole, else what is wrong with it (naming the file)."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.exists(path):
        return _header_problem(folder)
    try:
        with open(path, encoding="utf-8") as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} cannot be read ({e})"
    for rel, want in files.items():
        full = os.path.join(folder, rel)
        if not os.path.isfile(full):
            return f"{rel} is missing"
        size = os.path.getsize(full)
        if size != want["bytes"]:
            return f"{rel} has {size:,} bytes, the manifest says {want['bytes']:,} (truncated or replaced)"
    for rel, want in files.items():       # sizes first: they are cheap and catch most damage
        if sha256_of(os.path.join(folder, rel)) != want["sha256"]:
            return f"{rel} does not match its SHA-256 in {MANIFEST} (changed after the save)"
    return None


def _header_problem(folder: str) -> str | None:
    for rel in _HEADER_CHECKED:
        full = os.path.join(folder, rel)
        if not os.path.isfile(full):
            continue
        try:
            with safe_open(full, framework="pt"):
                pass
        except (SafetensorError, OSError) as e:
            return f"{rel} cannot be read ({' '.join(str(e).split())[:120]})"
    return None
