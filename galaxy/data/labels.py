"""Turning a raw label (index or class name) into a class index."""

import re

from .errors import DataError

# "3", " 3 ", "+3", "-1" are integer-like; "3.0" and "three" are not.
_INT_RE = re.compile(r"^\s*[+-]?\d+\s*$")


def _as_int(label):
    """The integer a label stands for, or None when it is a name."""
    if isinstance(label, bool):  # JSON true/false is not an index
        return None
    if isinstance(label, int):
        return label
    if isinstance(label, str) and _INT_RE.match(label):
        return int(label)
    return None


def resolve_label(label, class_names):
    """Map one raw label to a class index.

    label: an int, an integer-like string (an index into class_names), or a class
    name. An integer-like string is always read as an index, even if a class is
    literally named "0".
    class_names: list of names, or None when the file uses only integer labels; then
    any index >= 0 is accepted and the caller infers num_classes = max + 1.
    Raises DataError (no location; readers add `file:line`).
    """
    index = _as_int(label)
    if index is not None:
        if index < 0 or (class_names is not None and index >= len(class_names)):
            limit = f"0..{len(class_names) - 1}" if class_names is not None else ">= 0"
            raise DataError(f"label index {index} out of range ({limit})")
        return index
    if not isinstance(label, str):
        raise DataError(f"label must be an integer index or a class name, got {label!r}")
    name = label.strip()
    if not name:
        raise DataError("empty label")
    if class_names is None:
        raise DataError(f"label name {name!r} needs a class list "
                        "(only integer labels work without one)")
    try:
        return class_names.index(name)
    except ValueError:
        shown = ", ".join(repr(c) for c in class_names[:5])
        more = ", ..." if len(class_names) > 5 else ""
        raise DataError(f"unknown label name {name!r} (valid: {shown}{more})") from None


def inferred_class_names(examples):
    """Names "0".."max" for integer-only files read without a class list."""
    num_classes = max(label for _, label in examples) + 1
    return [str(i) for i in range(num_classes)]
