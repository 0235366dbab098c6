"""Tests for galaxy.train.metrics: JSON-lines writer and reader."""

import json
import math

import torch

from galaxy.train.metrics import MetricsWriter, read_metrics


def test_log_step_writes_exactly_the_documented_keys(tmp_path):
    path = tmp_path / "m.jsonl"
    writer = MetricsWriter(path, enabled=True)
    writer.log_step(step=3, loss=torch.tensor(0.5), lr=1e-4, tokens=torch.tensor(2048), time_s=1.25)
    writer.close()
    (line,) = path.read_text().splitlines()
    record = json.loads(line)
    assert record == {"step": 3, "loss": 0.5, "lr": 1e-4, "tokens": 2048, "time_s": 1.25}
    assert type(record["step"]) is int and type(record["tokens"]) is int
    assert type(record["loss"]) is float and type(record["lr"]) is float


def test_log_event_and_order_and_append(tmp_path):
    path = tmp_path / "m.jsonl"
    with MetricsWriter(path, enabled=True) as writer:
        writer.log_step(1, 2.0, 0.1, 64, 0.5)
        writer.log_event("eval", step=1, loss=1.5, accuracy=0.75)
    with MetricsWriter(path, enabled=True) as writer:  # a second run appends
        writer.log_event("done", steps=1, time_s=3.0)
    assert read_metrics(path) == [
        {"step": 1, "loss": 2.0, "lr": 0.1, "tokens": 64, "time_s": 0.5},
        {"event": "eval", "step": 1, "loss": 1.5, "accuracy": 0.75},
        {"event": "done", "steps": 1, "time_s": 3.0},
    ]


def test_each_line_is_flushed_immediately(tmp_path):
    path = tmp_path / "m.jsonl"
    writer = MetricsWriter(path, enabled=True)
    writer.log_event("start")
    assert read_metrics(path) == [{"event": "start"}]  # readable before close
    writer.close()


def test_parent_directories_are_created(tmp_path):
    path = tmp_path / "a" / "b" / "m.jsonl"
    with MetricsWriter(str(path), enabled=True) as writer:
        writer.log_event("x", value=1)
    assert read_metrics(path) == [{"event": "x", "value": 1}]


def test_disabled_or_no_path_writes_nothing(tmp_path):
    path = tmp_path / "sub" / "m.jsonl"
    with MetricsWriter(path, enabled=False) as writer:
        writer.log_step(1, 2.0, 0.1, 64, 0.5)
        writer.log_event("done")
    assert not path.exists() and not path.parent.exists()
    with MetricsWriter(None, enabled=True) as writer:
        writer.log_step(1, 2.0, 0.1, 64, 0.5)
        writer.log_event("done")


def test_non_finite_loss_stays_valid_json(tmp_path):
    path = tmp_path / "m.jsonl"
    with MetricsWriter(path, enabled=True) as writer:
        writer.log_step(1, math.nan, 0.1, 64, 0.5)
    text = path.read_text()
    assert "NaN" not in text
    assert json.loads(text)["loss"] is None
