"""Reading Hugging Face checkpoints and mapping parameter names both ways.

Only safe formats are read: safetensors, or pytorch_model.bin through
torch.load(weights_only=True). Sharded checkpoints (an *.index.json) are followed.

Two ways in: `read_hf_state_dict` returns every tensor (for callers that need whole state
dicts); `LazyCheckpoint` knows every tensor's name and shape and copies one tensor, or one
rank's slice of it, straight into a parameter, so that a rank reads only what it keeps.
"""
from __future__ import annotations

import json
import math
import os
import re

import torch
from safetensors import safe_open
from safetensors.torch import load_file


def checkpoint_files(model_path: str) -> tuple[str, list[str]]:
    """("safetensors" | "bin", the files holding the weights).

    An index (*.index.json, safetensors first) names the files of a sharded checkpoint; else the
    single model.safetensors, else the single pytorch_model.bin.
    """
    for fmt, index_name in (("safetensors", "model.safetensors.index.json"),
                            ("bin", "pytorch_model.bin.index.json")):
        index = os.path.join(model_path, index_name)
        if os.path.exists(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
            return fmt, [os.path.join(model_path, name) for name in files]
    for fmt, name in (("safetensors", "model.safetensors"), ("bin", "pytorch_model.bin")):
        single = os.path.join(model_path, name)
        if os.path.exists(single):
            return fmt, [single]
    raise FileNotFoundError(f"model_path {model_path!r} has no model.safetensors or pytorch_model.bin")


def read_hf_state_dict(model_path: str) -> dict[str, torch.Tensor]:
    fmt, files = checkpoint_files(model_path)
    reader = load_file if fmt == "safetensors" else _load_bin
    state = {}
    for path in files:
        state.update(reader(path))
    return state


def _load_bin(path: str, mmap: bool = False) -> dict[str, torch.Tensor]:
    if mmap:
        try:    # zip-format files (torch >= 1.6) map lazily: only the bytes used are read
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:    # the legacy format cannot be mapped: read it whole
            pass
    return torch.load(path, map_location="cpu", weights_only=True)


class LazyCheckpoint:
    """A Hugging Face checkpoint's tensor names and shapes, read on demand.

    read_into(name, out, dim, start) copies tensor `name`, or its slice
    [start, start + out.shape[dim]) along `dim`, into `out` (converting the dtype as copy_ does).
    safetensors: each read opens the file, takes only the requested slice (get_slice), a chunk
    of rows at a time, and closes it again, so the file pages a read maps are released before
    the next read; headers give the shapes without reading data. pytorch_model.bin: each file
    is loaded (memory-mapped where the format allows) when a tensor of it is first needed, one
    file at a time. Use it as a context manager, or call close().
    """

    def __init__(self, model_path: str):
        fmt, files = checkpoint_files(model_path)
        self._files = _SafetensorsFiles(files) if fmt == "safetensors" else _BinFiles(files)

    def __contains__(self, name: str) -> bool:
        return name in self._files.shapes

    def shape(self, name: str) -> tuple[int, ...]:
        return self._files.shapes[name]

    def read_into(self, name: str, out: torch.Tensor, dim: int | None = None, start: int = 0) -> None:
        self._files.read_into(name, out, dim, start)

    def close(self) -> None:
        self._files.close()

    def __enter__(self) -> "LazyCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _SafetensorsFiles:
    # Rows per read: at most this many checkpoint elements (16 MiB of fp32), so the file pages
    # one read maps stay small next to the model even for a large embedding table.
    CHUNK_ELEMENTS = 1 << 22

    def __init__(self, files: list[str]):
        self.path: dict[str, str] = {}                  # tensor name -> file
        self.shapes: dict[str, tuple[int, ...]] = {}
        for path in files:
            with safe_open(path, framework="pt") as f:  # the header only
                for name in f.keys():
                    self.path[name] = path
                    self.shapes[name] = tuple(f.get_slice(name).get_shape())

    def read_into(self, name, out, dim, start) -> None:
        shape = self.shapes[name]
        if not shape:                                   # a scalar
            with safe_open(self.path[name], framework="pt") as f:
                out.copy_(f.get_tensor(name))
            return
        # Read whole rows of the kept part, a chunk at a time: rows [start, start + n) when the
        # split is along dim 0 (a column-parallel weight [out, in]), else every row with only
        # the kept entries of dim (e.g. [:, start:start + n] of a row-parallel weight [out, in]).
        first, rows = (start, out.shape[0]) if dim == 0 else (0, shape[0])
        index = [slice(None)] * len(shape)
        if dim not in (None, 0):
            index[dim] = slice(start, start + out.shape[dim])
        step = max(1, self.CHUNK_ELEMENTS // max(1, math.prod(shape[1:])))
        for r in range(0, rows, step):
            n = min(step, rows - r)
            index[0] = slice(first + r, first + r + n)
            with safe_open(self.path[name], framework="pt") as f:
                src = f.get_slice(name)[tuple(index)]
                out.narrow(0, r, n).copy_(src)
                del src     # it may view the file's mapping, which closing releases

    def close(self) -> None:
        pass            # no file stays open between reads


class _BinFiles:
    def __init__(self, files: list[str]):
        self.path: dict[str, str] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._loaded: tuple[str, dict] | None = None    # the one file held, (path, state)
        for path in files:
            for name, tensor in self._state(path).items():
                self.path[name] = path
                self.shapes[name] = tuple(tensor.shape)

    def _state(self, path: str) -> dict[str, torch.Tensor]:
        if self._loaded is None or self._loaded[0] != path:
            self._loaded = None                         # drop the previous file first
            self._loaded = (path, _load_bin(path, mmap=True))
        return self._loaded[1]

    def read_into(self, name, out, dim, start) -> None:
        src = self._state(self.path[name])[name]
        out.copy_(src if dim is None else src.narrow(dim, start, out.shape[dim]))

    def close(self) -> None:
        self._loaded = None


class NameMap:
    """Translate names with a table of patterns: {i} matches a layer index, other fields any text."""

    def __init__(self, table: dict[str, str]):
        self.rules = [(self._regex(ours), theirs) for ours, theirs in table.items()]

    @staticmethod
    def _regex(pattern: str) -> re.Pattern:
        out = re.escape(pattern)
        out = out.replace(re.escape("{i}"), r"(?P<i>\d+)")
        out = re.sub(r"\\\{(\w+)\\\}", lambda m: f"(?P<{m.group(1)}>.+)", out)
        return re.compile(f"^{out}$")

    def __call__(self, name: str) -> str:
        for regex, target in self.rules:
            m = regex.match(name)
            if m:
                return target.format(**m.groupdict())
        raise KeyError(f"no Hugging Face name for parameter {name!r}")


def pre_norm_names(table: NameMap, num_layers: int, next_norm: str, final_norm: str):
    """galaxy name -> HF name for a pre-norm decoder, whose CON2 of layer i holds the norm that
    Hugging Face files under layer i + 1 (`next_norm`, e.g. "model.layers.{i}.input_layernorm.{w}")
    and, after the last layer, the final norm (`final_norm`, e.g. "model.norm.{w}"); every other
    name goes through `table`."""
    last = num_layers - 1

    def to_hf(name: str) -> str:
        parts = name.split(".")
        if parts[0] == "layers" and parts[2] == "con2" and parts[3] == "norm":
            i, w = int(parts[1]), parts[4]
            return final_norm.format(w=w) if i == last else next_norm.format(i=i + 1, w=w)
        return table(name)
    return to_hf
