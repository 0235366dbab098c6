"""Embedded default dataset: Python documentation topics, built from the stdlib.

Task
----
Given a short passage (80-470 characters, median ~65 MiniLM tokens) of the Python
reference manual, say which area of the language documentation it comes from. The
text is `pydoc_data.topics.topics` (ships with CPython, no download), so the dataset
depends only on the Python version (counts below are for CPython 3.11).

Classes (index: name -- pydoc topic keys, see CLASS_TOPICS)
  0 statements       -- simple and compound statements (assert, import, try, def, ...)
  1 expressions      -- atoms, operators, comparisons, calls, displays, lambda, yield
  2 data-model       -- objects, the standard type hierarchy, special methods/attributes
  3 builtin-types    -- methods of str/list/dict/..., format spec mini-language, truth
  4 lexical          -- identifiers, keywords, string and numeric literals
  5 execution        -- execution model, naming/binding, exceptions, the pdb debugger

Umbrella topics whose text repeats other topics ("compound", "specialnames", "else")
are left out, and any paragraph already seen in an earlier topic is dropped, so no
passage appears twice or under two classes.

Samples
-------
Each topic is split into paragraphs (blank-line separated; heading underlines
removed, whitespace collapsed). Consecutive paragraphs are packed into a sample until
it reaches MIN_CHARS; a paragraph longer than MAX_CHARS is cut into word windows
first. Samples shorter than DROP_CHARS (topic tails) are dropped.

Split rule
----------
By a stable hash of the sample text: sha256(text) mod 10 == 0 -> test, == 1 -> dev,
else train (~80/10/10). Passages are unseen at dev/test time, but their topics are
not: the task is "which manual area is this passage from", learnable within one
epoch yet far from trivial (6 classes, chance ~1/6, majority class ~25%). No use of
Python's salted hash(), so every process and run gets the same split.

Counts (CPython 3.11.7): train 968, dev 127, test 114 samples.
Per class (train/dev/test): statements 186/26/26, expressions 140/18/13,
data-model 243/30/32, builtin-types 255/30/30, lexical 48/10/4, execution 96/13/9.
"""

import functools
import hashlib
import re

CLASS_TOPICS = {
    "statements": [
        "assert", "assignment", "augassign", "async", "break", "class", "continue",
        "del", "for", "function", "global", "if", "import", "nonlocal", "pass",
        "raise", "return", "try", "while", "with",
    ],
    "expressions": [
        "atom-identifiers", "atom-literals", "attribute-references", "await",
        "binary", "bitwise", "booleans", "calls", "comparisons", "conversions",
        "dict", "exprlists", "in", "lambda", "lists", "operator-summary", "power",
        "shifting", "slicings", "subscriptions", "unary", "yield",
    ],
    "data-model": [
        "attribute-access", "callable-types", "context-managers", "customization",
        "numeric-types", "objects", "sequence-types", "specialattrs", "types",
    ],
    "builtin-types": [
        "bltin-code-objects", "bltin-ellipsis-object", "bltin-null-object",
        "bltin-type-objects", "formatstrings", "string-methods", "truth",
        "typesfunctions", "typesmapping", "typesmethods", "typesmodules", "typesseq",
        "typesseq-mutable",
    ],
    "lexical": [
        "floating", "id-classes", "identifiers", "imaginary", "integers", "numbers",
        "strings",
    ],
    "execution": ["debugger", "dynamic-features", "exceptions", "execmodel", "naming"],
}
CLASS_NAMES = list(CLASS_TOPICS)

MIN_CHARS = 120    # pack paragraphs until a sample is at least this long
MAX_CHARS = 350    # longer paragraphs are cut into word windows of about this size
DROP_CHARS = 80    # shorter leftovers carry too little signal
SPLITS = ("train", "dev", "test")

# A heading underline such as "*****" or "=====" (rst section markup).
_UNDERLINE = re.compile(r"^\s*([*=\-~^+])\1{2,}\s*$")


def _paragraphs(text):
    """Whitespace-collapsed paragraphs of one topic, heading underlines removed."""
    lines = [line for line in text.splitlines() if not _UNDERLINE.match(line)]
    for block in re.split(r"\n\s*\n", "\n".join(lines)):
        para = " ".join(block.split())
        if para:
            yield para


def _windows(para):
    """Cut one paragraph into pieces of at most ~MAX_CHARS on word boundaries."""
    piece = []
    size = 0
    for word in para.split(" "):
        if piece and size + 1 + len(word) > MAX_CHARS:
            yield " ".join(piece)
            piece, size = [], 0
        piece.append(word)
        size += len(word) + (1 if size else 0)
    if piece:
        yield " ".join(piece)


def _samples(paragraphs):
    """Pack consecutive paragraphs (already cut to <= MAX_CHARS) into samples."""
    current = ""
    for para in paragraphs:
        for piece in _windows(para):
            current = f"{current} {piece}" if current else piece
            if len(current) >= MIN_CHARS:
                yield current
                current = ""
    if len(current) >= DROP_CHARS:
        yield current


def _split_of(text):
    """Stable split for a sample: sha256 of its utf-8 text, bucket mod 10."""
    bucket = int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") % 10
    return "test" if bucket == 0 else "dev" if bucket == 1 else "train"


@functools.lru_cache(maxsize=1)
def _build():
    """{split: tuple of (text, label, topic key)} in a fixed order (class, then topic key order)."""
    from pydoc_data.topics import topics  # stdlib; imported lazily (~0.5 MB of text)

    seen = set()  # paragraphs already used; drops text repeated across topics
    splits = {name: [] for name in SPLITS}
    for label, name in enumerate(CLASS_NAMES):
        for key in CLASS_TOPICS[name]:
            if key not in topics:  # a different CPython may lack a topic
                continue
            fresh = [p for p in _paragraphs(topics[key]) if p not in seen]
            seen.update(fresh)
            for text in _samples(fresh):
                splits[_split_of(text)].append((text, label, key))
    return {name: tuple(rows) for name, rows in splits.items()}


def _rows(split):
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r} (use one of {', '.join(SPLITS)})")
    return _build()[split]


def pydoc_topics_dataset(split):
    """(examples, class_names) for split "train"/"dev"/"test"; examples: [(text, label)]."""
    return [(text, label) for text, label, _ in _rows(split)], list(CLASS_NAMES)


def pydoc_titles_dataset(split):
    """The sequence-to-sequence form: [(passage, its topic's title)], the title the pydoc topic
    key with spaces for dashes ("string-methods" -> "string methods"); the same passages and
    splits as pydoc_topics_dataset."""
    return [(text, key.replace("-", " ")) for text, _, key in _rows(split)]
