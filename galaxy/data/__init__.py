"""Text-classification data: file readers, the embedded pydoc-topics dataset, batches.

Importing this package does not import transformers; the tokenizer is passed in.
"""

from .batches import ClassificationBatches
from .errors import DataError
from .labels import resolve_label
from .loading import load_examples
from .pydoc_topics import pydoc_topics_dataset
from .readers import read_examples

__all__ = [
    "ClassificationBatches",
    "DataError",
    "load_examples",
    "pydoc_topics_dataset",
    "read_examples",
    "resolve_label",
]
