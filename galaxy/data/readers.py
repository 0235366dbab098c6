"""Readers for labelled text files: TSV (THUCNews `text<TAB>label`), CSV, JSONL.

Each reader yields raw records (line, text, raw_label); `read_examples` resolves the
labels and turns every problem into a DataError naming `file:line`. Inputs to predict
(`read_inputs`) may leave the label out: a TSV line without a tab, a CSV without the label
column, a JSON object without "label" (raw_label None).
"""

import csv
import json
import os

from .errors import DataError
from .labels import inferred_class_names, resolve_label


def _lines(path):
    """(line_number, line without newline) for every line; utf-8, BOM tolerated."""
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            for number, line in enumerate(f, start=1):
                yield number, line.rstrip("\r\n")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not valid UTF-8 ({e.reason} at byte {e.start})") from None


def read_tsv(path, optional: bool = False):
    """THUCNews style: `text<TAB>label` per line; the label is after the LAST tab."""
    for number, line in _lines(path):
        if not line.strip():
            continue
        if "\t" not in line and optional:
            yield number, line, None
            continue
        if "\t" not in line:
            raise DataError(f"{path}:{number}: missing tab between text and label")
        text, label = line.rsplit("\t", 1)
        yield number, text, label


def read_csv(path, optional: bool = False):
    """CSV with a header row that has `text` and `label` columns (others ignored)."""
    with open(path, encoding="utf-8-sig", newline="") as f:
        reader = csv.reader(f)
        try:
            header = next(reader, None)
            if header is None:
                return
            columns = [c.strip() for c in header]
            missing = [c for c in ("text",) + (() if optional else ("label",)) if c not in columns]
            if missing:
                raise DataError(f"{path}:1: header lacks column(s) {', '.join(missing)} "
                                f"(has {columns})")
            text_col = columns.index("text")
            label_col = columns.index("label") if "label" in columns else None
            start = reader.line_num + 1  # first physical line of the next record
            for row in reader:
                number, start = start, reader.line_num + 1
                if not row or not any(cell.strip() for cell in row):
                    continue  # blank line
                if len(row) != len(columns):
                    raise DataError(f"{path}:{number}: expected {len(columns)} fields, "
                                    f"got {len(row)}")
                yield number, row[text_col], None if label_col is None else row[label_col]
        except csv.Error as e:
            raise DataError(f"{path}:{reader.line_num}: bad CSV ({e})") from None
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not valid UTF-8 ({e.reason} at byte {e.start})") from None


def read_jsonl(path, optional: bool = False):
    """One JSON object per line with `text` (string) and `label` (int or name)."""
    for number, line in _lines(path):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{number}: bad JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(record, dict):
            raise DataError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
        missing = [k for k in ("text",) + (() if optional else ("label",)) if k not in record]
        if missing:
            raise DataError(f"{path}:{number}: missing field(s) {', '.join(missing)}")
        if not isinstance(record["text"], str):
            raise DataError(f"{path}:{number}: text must be a string")
        yield number, record["text"], record.get("label")


# Format by extension; .txt is THUCNews' own name for its TSV files.
READERS = {".tsv": read_tsv, ".txt": read_tsv, ".csv": read_csv,
           ".jsonl": read_jsonl, ".json": read_jsonl}


def read_examples(path, class_names=None):
    """Read a labelled file -> (examples, class_names).

    examples: list of (text, label_index). class_names: the given list, or, for an
    integer-labelled file read with class_names=None, ["0", ..., str(max_label)]
    (num_classes inferred as max + 1). Raises DataError on any bad row.
    """
    path = os.fspath(path)
    ext = os.path.splitext(path)[1].lower()
    if ext not in READERS:
        raise DataError(f"{path}: unknown extension {ext!r} "
                        f"(use one of {', '.join(sorted(READERS))})")
    names = list(class_names) if class_names is not None else None
    examples = []
    for number, text, raw_label in READERS[ext](path):
        text = text.strip()
        if not text:
            raise DataError(f"{path}:{number}: empty text")
        try:
            label = resolve_label(raw_label, names)
        except DataError as e:
            raise DataError(f"{path}:{number}: {e}") from None
        examples.append((text, label))
    if not examples:
        raise DataError(f"{path}: no examples")
    return examples, names if names is not None else inferred_class_names(examples)


def read_inputs(path, class_names):
    """Texts to classify, labelled or not -> [(text, label_index or None)] (class_names fixed)."""
    path = os.fspath(path)
    ext = os.path.splitext(path)[1].lower()
    if ext not in READERS:
        raise DataError(f"{path}: unknown extension {ext!r} (use one of {', '.join(sorted(READERS))})")
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such file")
    inputs = []
    for number, text, raw_label in READERS[ext](path, optional=True):
        if not text.strip():
            raise DataError(f"{path}:{number}: empty text")
        try:
            label = None if raw_label is None else resolve_label(raw_label, list(class_names))
        except DataError as e:
            raise DataError(f"{path}:{number}: {e}") from None
        inputs.append((text.strip(), label))
    if not inputs:
        raise DataError(f"{path}: no inputs")
    return inputs
