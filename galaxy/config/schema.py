"""How a config key is declared, and how a JSON value is checked against its declaration.

A key is a field of one of the section dataclasses (galaxy.config.keys). Its type annotation says
what JSON value it takes, and everything else follows from it:

    int, float, str, bool      a JSON number / string / boolean (a float key takes an integer,
                               an int key takes no boolean); floats must be finite
    list[int], list[str]       a JSON list of those
    Literal["a", "b"]          one of those strings
    X | None                   also null (stored as None, or as `null_as` where a key says so)
    A | B                      either (activation_checkpointing, class_list)

and its `key(...)` metadata carries the rest: the one-line doc (the key reference in
docs/configuration.md is generated from it), a range (`at_least`, `above`, `below`), and a path
rule (`path`: resolved against the current directory). A new key is one field, in one place.
"""
from __future__ import annotations

import json
import math
import types
import typing
from dataclasses import MISSING, Field, field, fields
from typing import Literal, get_args, get_origin

from galaxy.config.errors import ConfigError


def key(default, doc: str, *, at_least=None, above=None, below=None, path: str | None = None,
        null_as=None, kind: str | None = None) -> Field:
    """A config key's field. at_least / above / below: the range a number must lie in (a list
    of integers: each entry); path: "read" (must exist), "folder" (need not exist) or None;
    null_as: what JSON null is stored as (default None); kind: the phrase an error uses for the
    value's type, where the annotation's own would mislead."""
    meta = {"doc": doc, "at_least": at_least, "above": above, "below": below, "path": path,
            "null_as": null_as, "kind": kind}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def declared(section) -> list[tuple[Field, object]]:
    """(field, resolved type) of every declared key of a section class, in declaration order."""
    hints = typing.get_type_hints(section)
    return [(f, hints[f.name]) for f in fields(section) if "doc" in f.metadata]


def default_of(f: Field):
    return f.default_factory() if f.default is MISSING else f.default


# --- parsing one value ------------------------------------------------------------------------------

def parse(name: str, value, typ, meta: dict):
    """The value converted to its declared type, or ConfigError naming the key and what it takes."""
    options = members(typ)
    if value is None:
        if type(None) in options:
            return meta.get("null_as")
        raise ConfigError(f"{name} must be {describe(typ, meta)}, got {show(value)}")
    for member in options:
        ok, out = _parse_one(name, value, member)
        if ok:
            return out
    literal = [m for m in options if get_origin(m) is Literal]
    if literal and len(options) - (type(None) in options) == 1:
        valid = ", ".join(f"'{v}'" for v in get_args(literal[0]))
        raise ConfigError(f"{name} must be one of {valid}{' or null' if type(None) in options else ''}, "
                          f"got {show(value)}")
    raise ConfigError(f"{name} must be {describe(typ, meta)}, got {show(value)}")


def members(typ) -> tuple:
    if get_origin(typ) in (typing.Union, types.UnionType):
        return get_args(typ)
    return (typ,)


def _parse_one(name: str, value, typ) -> tuple[bool, object]:
    """(accepted, converted). A list of the right kind with a bad entry raises: the entry is named."""
    if get_origin(typ) is Literal:
        return value in get_args(typ), value
    if typ is bool:
        return isinstance(value, bool), value
    if typ is int:
        return is_int(value), value
    if typ is float:
        if not (is_int(value) or isinstance(value, float)):
            return False, None
        if not math.isfinite(value):
            raise ConfigError(f"{name} must be a finite number, got {value}")
        return True, float(value)
    if typ is str:
        return isinstance(value, str), value
    if get_origin(typ) is list and isinstance(value, list):
        item = get_args(typ)[0]
        for i, v in enumerate(value):
            if not (is_int(v) if item is int else isinstance(v, item)):
                what = "an integer" if item is int else "a string"
                raise ConfigError(f"{name}[{i}] must be {what}, got {show(v)}")
        return True, list(value)
    return False, None


# --- describing -----------------------------------------------------------------------------------

_PHRASES = {int: "an integer", float: "a number", str: "a string", bool: "true or false", type(None): "null"}


def describe(typ, meta: dict | None = None) -> str:
    """What a key takes, in words: 'an integer or null', "one of 'TP', 'SP'"."""
    if meta and meta.get("kind"):
        return meta["kind"] + (" or null" if type(None) in members(typ) else "")
    parts = []
    for member in members(typ):
        if get_origin(member) is Literal:
            parts.append("one of " + ", ".join(f"'{v}'" for v in get_args(member)))
        elif get_origin(member) is list:
            parts.append(f"a list of {'integers' if get_args(member)[0] is int else 'strings'}")
        else:
            parts.append(_PHRASES[member])
    return " or ".join(parts)


def range_problem(name: str, value, meta: dict) -> str | None:
    """The line for a number (or a list entry) outside the key's declared range, else None."""
    items = value if isinstance(value, list) else [value]
    for i, v in enumerate(items):
        where = f"{name}[{i}]" if isinstance(value, list) else name
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if meta.get("at_least") is not None and v < meta["at_least"]:
            bound = meta["at_least"]
            text = "at least 1" if bound == 1 else f"{bound} or more"
            return f"{where} must be {text}, got {v}"
        if meta.get("above") is not None and v <= meta["above"]:
            return f"{where} must be greater than {meta['above']}, got {v}"
        if meta.get("below") is not None and v >= meta["below"]:
            return f"{where} must be in [0, {meta['below']}), got {v}"
    return None


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # true/false are not counts


def show(value) -> str:
    """A JSON value as the user wrote it, with its JSON type, kept short for one line."""
    text = json.dumps(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    kind = {bool: "boolean", int: "integer", float: "number", str: "string", list: "list",
            dict: "object", type(None): "null"}.get(type(value), type(value).__name__)
    return f"{text} ({kind})"
