"""A model folder's weights checked from their headers alone, before any process group starts.

Every weight file is opened (safetensors: its header; pytorch_model.bin: memory-mapped, with
torch.load(weights_only=True)), so a missing, truncated or foreign file is named here instead of
surfacing as a deserialiser's message on every rank after the rendezvous. Then the model its
config.json describes is built on the meta device (shapes only, no memory) and every parameter is
looked up in those headers by galaxy.models.build.locate_weights, the very function the real
build uses: a checkpoint that passes here loads there.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from safetensors import SafetensorError, safe_open

from galaxy.config import ConfigError
from galaxy.models.build import CheckpointError, load_hf_config, locate_weights, model_class
from galaxy.models.registry import family_of
from galaxy.models.weights import checkpoint_files

WEIGHT_FILES = "model.safetensors, model.safetensors.index.json with its shards, or pytorch_model.bin"


class WeightIndex:
    """Tensor name -> (file, shape) of a model folder, from the headers. Has the two methods
    locate_weights asks of a checkpoint (`in`, shape) and remembers the last name it was asked
    about, so that an error can say which file holds the tensor."""

    def __init__(self, model_dir: str, what: str):
        self.model_dir, self.what = model_dir, what
        try:
            self.fmt, self.files = checkpoint_files(model_dir)
        except FileNotFoundError:
            raise ConfigError(f"{what} {model_dir!r} has config.json but no weights; it needs {WEIGHT_FILES} "
                              "next to config.json") from None
        except (OSError, ValueError, KeyError) as e:
            raise ConfigError(f"{what} {model_dir!r}: its weight index cannot be read ({e}); copy the model "
                              "folder again") from None
        self.entries: dict[str, tuple[str, tuple[int, ...]]] = {}
        for path in self.files:
            for name, shape in self._read_header(path).items():
                self.entries[name] = (path, shape)
        self.last: str | None = None

    def _read_header(self, path: str) -> dict[str, tuple[int, ...]]:
        name = os.path.relpath(path, self.model_dir)
        if not os.path.isfile(path):
            raise ConfigError(f"{self.what} {self.model_dir!r}: {name} is named by the weight index but missing; "
                              "copy the model folder again")
        size = os.path.getsize(path)
        try:
            if self.fmt == "safetensors":
                with safe_open(path, framework="pt") as f:
                    return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
            # Memory-mapped: the shapes without reading the data (legacy, unmappable files are rare).
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            return {k: tuple(t.shape) for k, t in state.items()}
        except (SafetensorError, RuntimeError, OSError, ValueError, EOFError, AttributeError) as e:
            reason = " ".join(str(e).split())[:160]
            raise ConfigError(f"{self.what} {self.model_dir!r}: {name} ({size:,} bytes) cannot be read: {reason}; "
                              "the file is truncated or damaged, copy it again") from None

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def shape(self, name: str) -> tuple[int, ...]:
        self.last = name
        return self.entries[name][1]

    def file_of(self, name: str) -> str:
        return os.path.relpath(self.entries[name][0], self.model_dir)


@dataclass
class ModelFacts:
    """What the checks learnt about the model a job builds (for --check's summary)."""
    source: str                # the folder the weights come from (model_path or a checkpoint's model/)
    model_type: str
    parameters: int            # of the whole model, at full size
    layers: int
    hidden_size: int
    head_rows: int | None      # outputs of the checkpoint's classifier; None: no classifier in it
    new_head: bool             # a classifier is initialised afresh (none in the weights, or re-initialised)


def classifier_rows(index: WeightIndex, family, hf_config) -> tuple[int, str] | None:
    """(outputs, HF name) of the classifier the weights hold; None when they hold none."""
    to_hf = family.hf_names(hf_config)
    for name in family.hf_head_params:
        if name.endswith("weight") and to_hf(name) in index:
            return index.shape(to_hf(name))[0], to_hf(name)
    return None


def meta_model(hf_config, num_labels: int | None, task: str | None = None):
    """The whole model for `task` (None: the family's primary one) on the meta device: names and
    shapes, no storage."""
    with torch.device("meta"):
        return model_class(family_of(hf_config.model_type), task)(hf_config, num_labels=num_labels)


def check_weights(model_dir: str, what: str, num_labels: int | None, *, reinit_head: bool = False,
                  reinit_hint: bool = True, task: str | None = None) -> tuple[ModelFacts, torch.nn.Module]:
    """Check the folder's weights against the model its config.json describes (with num_labels
    classifier outputs). reinit_head: a classifier of another size is going to be re-initialised
    (ignore_mismatched_sizes), so it is not an error. Returns the facts and the meta model."""
    index = WeightIndex(model_dir, what)
    try:
        hf_config = load_hf_config(model_dir)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{what} {model_dir!r}: config.json cannot be read by transformers: "
                          f"{' '.join(str(e).split())[:200]}") from None
    family = family_of(hf_config.model_type)
    head = classifier_rows(index, family, hf_config) if num_labels is not None else None
    build_labels = num_labels
    if head is not None and head[0] != num_labels:
        rows, name = head
        if not reinit_head:
            fix = ('set "ignore_mismatched_sizes": true to train a new, randomly initialised classifier, or '
                   if reinit_hint else "")
            raise ConfigError(f"{what} {model_dir!r}: its classifier ({name} in {index.file_of(name)}) has {rows} "
                              f"outputs but the task has {num_labels} classes (class_list or the data's labels); "
                              f"{fix}give a class_list of {rows} names")
        build_labels = rows
    model = meta_model(hf_config, build_labels, task)
    try:
        locate_weights(model, index, family)
    except CheckpointError as e:
        reason = str(e).replace(" (check num_labels / class_list)", "")
        where = f" in {index.file_of(index.last)}" if index.last in index else ""
        raise ConfigError(f"{what} {model_dir!r}: {reason}{where}; the weights do not fit its config.json "
                          "(another model's weights or config?): copy the model folder again") from None
    facts = ModelFacts(model_dir, hf_config.model_type, sum(p.numel() for p in model.parameters()),
                       len(model.layers), hf_config.hidden_size, head[0] if head else None,
                       num_labels is not None and (head is None or head[0] != num_labels))
    return facts, model


def read_config_json(model_dir: str) -> dict:
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        return json.load(f)
