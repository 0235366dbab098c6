"""One entry point for "give me labelled examples": a file, a folder, or the default."""

import os

from .errors import DataError
from .pydoc_topics import SPLITS, pydoc_topics_dataset
from .readers import READERS, read_examples


def _split_file(folder, split):
    """`folder/{split}.{tsv,txt,csv,jsonl,json}`; exactly one must exist."""
    found = [os.path.join(folder, split + ext) for ext in sorted(READERS)]
    found = [p for p in found if os.path.isfile(p)]
    if len(found) != 1:
        what = "no" if not found else "several"
        raise DataError(f"{folder}: {what} {split} file(s) ({', '.join(found) or split + '.*'})")
    return found[0]


def load_examples(path_or_none, split, class_list=None):
    """(examples, class_names) where examples is a list of (text, label_index).

    path_or_none: None -> the embedded pydoc-topics dataset's `split`; a file -> that
    file (split is then only a name); a folder -> its `{split}.<ext>` file (THUCNews
    layout: train.txt / dev.txt / test.txt).
    split: "train", "dev" or "test".
    class_list: label names fixing the index order, or None (files: integer labels
    only, num_classes = max + 1; embedded dataset: its own names). For the embedded
    dataset a given class_list must equal its class names.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r} (use one of {', '.join(SPLITS)})")
    if path_or_none is None:
        examples, names = pydoc_topics_dataset(split)
        if class_list is not None and list(class_list) != names:
            raise DataError(f"class list {list(class_list)} does not match "
                            f"the embedded dataset's {names}")
        return examples, names
    path = os.fspath(path_or_none)
    if os.path.isdir(path):
        path = _split_file(path, split)
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such file")
    return read_examples(path, class_list)
