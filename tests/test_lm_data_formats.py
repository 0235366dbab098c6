"""Causal-LM data users already have: text records (openassistant-guanaco), chat records (with the
tokenizer's chat template, or galaxy's ### Human / ### Assistant template), instruction records;
the reader names the formats it found and, for a record that fits none, the line and the fields."""
import json

import pytest

from galaxy.data import DataError
from galaxy.data.causal_lm import (IGNORE_INDEX, describe_samples, encode_lm_sample, encode_sample,
                                   read_lm_samples, render_samples)
from galaxy.assets.tiny_llama import default_tokenizer

GUANACO = ("### Human: Can you write a short introduction about the relevance of the term \"monopsony\"?"
           "### Assistant: \"Monopsony\" refers to a market structure where there is only one buyer.")
CHAT = {"messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "Name a loop."},
                     {"role": "assistant", "content": "for"},
                     {"role": "user", "content": "Another?"},
                     {"role": "assistant", "content": "while, as in while True: pass"}]}
PAD = 96
# A ChatML-like template: the end-of-turn marker is the tokenizer's EOS.
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.fixture(scope="module")
def tok():
    return default_tokenizer()      # the tiny Llama's BPE tokenizer: no chat template of its own


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def labelled_runs(tok, ids, labels):
    """The decoded text of each maximal run of labelled tokens (labels equal to the ids)."""
    runs, run = [], []
    for i, label in zip(ids.tolist(), labels.tolist()):
        if label == IGNORE_INDEX:
            if run:
                runs.append(tok.decode(run))
            run = []
        else:
            assert label == i
            run.append(i)
    return runs + ([tok.decode(run)] if run else [])


def test_guanaco_text_records_train_on_every_token(tok, tmp_path):
    path = write_jsonl(tmp_path / "guanaco.jsonl", [{"text": GUANACO}, {"text": "### Human: Hi### Assistant: Hello"}])
    samples = read_lm_samples(path)
    assert samples == [(GUANACO, None), ("### Human: Hi### Assistant: Hello", None)]
    ids, mask, labels = encode_sample(tok, samples[0], PAD)
    assert (ids, mask, labels)[0].tolist() == encode_lm_sample(tok, GUANACO, None, PAD)[0].tolist()
    n = int(mask.sum())
    assert labels[:n].tolist() == ids[:n].tolist() and (labels[n:] == IGNORE_INDEX).all()
    assert describe_samples(path, samples, tok) == f"{path}: 2 text records (loss on every token)"


def test_chat_records_without_template_train_on_assistant_turns(tok, tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [CHAT])
    (rendered,) = render_samples(read_lm_samples(path), tok)
    assert rendered.text == ("### System: Be brief.\n### Human: Name a loop.\n### Assistant: for</s>\n"
                             "### Human: Another?\n### Assistant: while, as in while True: pass</s>\n")
    ids, mask, labels = encode_sample(tok, rendered, PAD)
    assert ids[0].item() == tok.bos_token_id                       # tokenised like plain text
    assert [r.strip() for r in labelled_runs(tok, ids, labels)] == ["for</s>", "while, as in while True: pass</s>"]
    assert "galaxy's ### Human / ### Assistant template" in describe_samples(path, read_lm_samples(path), tok)


def test_chat_records_use_the_tokenizers_chat_template(tok, tmp_path):
    templated = default_tokenizer()
    templated.chat_template = TEMPLATE
    path = write_jsonl(tmp_path / "chat.jsonl", [CHAT])
    (rendered,) = render_samples(read_lm_samples(path), templated)
    assert rendered.text == templated.apply_chat_template(CHAT["messages"], tokenize=False)
    ids, mask, labels = encode_sample(templated, rendered, PAD)
    want = templated.apply_chat_template(CHAT["messages"], tokenize=True)
    want = want if isinstance(want, list) else want["input_ids"]     # a BatchEncoding in transformers 5
    n = int(mask.sum())
    assert ids[:n].tolist() == list(want)                           # exactly apply_chat_template's tokens
    assert [r.strip() for r in labelled_runs(templated, ids, labels)] == ["for</s>", "while, as in while True: pass</s>"]
    assert "the tokenizer's chat template" in describe_samples(path, read_lm_samples(path), templated)


def test_mixed_formats_are_counted(tok, tmp_path):
    path = write_jsonl(tmp_path / "mixed.jsonl", [{"text": "a b"}, CHAT, {"instruction": "Name a loop.", "output": "for"}])
    note = describe_samples(path, read_lm_samples(path), tok)
    assert "1 text records" in note and "1 chat records" in note and "1 instruction records (loss on the response)" in note


def test_record_fitting_no_format_names_line_and_fields(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"text": "fine"}, {"prompt": "x", "completion": "y"}])
    with pytest.raises(DataError) as info:
        read_lm_samples(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}:2: a record with fields ['completion', 'prompt'] fits no format")
    assert '"text"' in msg and '"messages"' in msg and '"instruction" and "output"' in msg


def test_bad_chat_records_name_the_line(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [CHAT, {"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(DataError, match=r"bad\.jsonl:2: 'messages' has no non-empty assistant turn"):
        read_lm_samples(path)
    write_jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "bot", "content": "hi"}]}])
    with pytest.raises(DataError, match=r"bad\.jsonl:1: messages\[0\] must be"):
        read_lm_samples(path)
