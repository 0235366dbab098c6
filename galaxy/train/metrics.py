"""JSON-lines training metrics: one object per line, written by global rank 0 only."""

import json
import math
import os


def _plain(value):
    """A JSON-safe plain value: tensors/numpy scalars -> Python numbers, NaN/inf -> None."""
    if hasattr(value, "item") and callable(value.item):
        value = value.item()  # 0-d torch tensor or numpy scalar
    if isinstance(value, float) and not math.isfinite(value):
        return None  # strict JSON has no NaN/Infinity; null keeps the line parseable
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


class MetricsWriter:
    """Append JSON lines to `path` (parent folders created), flushed per line.

    log_step -> {"step", "loss", "lr", "tokens", "time_s"} (+ "grad_norm" with clip_grad);
    log_event -> {"event": name, **fields}, e.g. {"event": "start", "step": k0,
    "resumed_from": path or None}, {"event": "eval", "step": k, "loss": L,
    "accuracy": a}, {"event": "test", ...} or {"event": "done", ...}.
    Disabled (enabled=False, e.g. ranks other than 0) or path=None: every method
    is a no-op and no file is touched.
    """

    def __init__(self, path, enabled=True):
        self.path = os.fspath(path) if path is not None else None
        self.enabled = bool(enabled) and self.path is not None
        self._file = None

    def _write(self, record):
        if not self.enabled:
            return
        if self._file is None:
            parent = os.path.dirname(self.path)
            if parent:
                os.makedirs(parent, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")
        self._file.write(json.dumps(_plain(record), allow_nan=False) + "\n")
        self._file.flush()

    def log_step(self, step, loss, lr, tokens, time_s, **extra):
        """extra: optional fields, e.g. grad_norm when clipping is on."""
        if not self.enabled:  # return before float(loss): no device sync off rank 0
            return
        self._write({"step": int(step), "loss": float(loss), "lr": float(lr),
                     "tokens": int(tokens), "time_s": float(time_s), **extra})

    def log_event(self, event, **fields):
        if not self.enabled:
            return
        self._write({"event": event, **fields})

    def close(self):
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_metrics(path):
    """All records of a metrics file, in order, as a list of dicts (blank lines skipped)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def current_run(records):
    """The records that make up the latest run's history, resumes included.

    A metrics file is appended to: runs that started afresh, and runs resumed from a checkpoint
    at step k0 (which replay steps after k0 that an interrupted run had already logged). Each
    run begins with {"event": "start", "step": k0, "resumed_from": ...}. Walking forward, a
    fresh start drops everything before it and a resume drops what was logged after its k0, so
    what remains is exactly one value per step.
    """
    kept = []
    for r in records:
        if r.get("event") == "start":
            k0 = r.get("step", 0)
            if not r.get("resumed_from"):
                kept = []
            kept = [x for x in kept if x.get("step", 0) <= k0 and x.get("event") != "done"]
        kept.append(r)
    return kept
