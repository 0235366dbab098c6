"""Ranks agree before they train: same world size, same settings, one job per port.

Ranks started with different configs (say other head shares in the plan) would otherwise
train to the end with wrong numbers, and ranks with different --world, or a job started on a
port another job holds, would wait on gloo's own connect timeout instead of timeout_s. So the
rendezvous is done in two steps (galaxy.launch.init_distributed):

1. open_store: the c10d store every process group is built on. For tcp:// rank 0 binds it
   itself: a port in use fails at once ("port in use"), not after a timeout.
2. agree: over that store, before any process group exists, each rank claims its rank number
   (a rank already claimed means another job owns the port), reads rank 0's fingerprint and
   posts its own. Every rank compares its own with rank 0's; rank 0 compares every rank's and
   posts the verdict, which the others wait for. A mismatch is one line naming the first key
   that differs, on every rank (exit status 2); every wait is bounded by timeout_s.

The fingerprint (fingerprint()) is the resolved config, the plan's world size, the script's own
arguments, the model's shape from config.json, the training data (count, classes and a digest)
and the checkpoint step a resume starts from. Paths are left out (on several machines the same
files may live at different paths); what they hold is compared instead. Weight values are not.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from datetime import timedelta
from urllib.parse import urlparse

import torch.distributed as dist

# Config keys naming local files: compared by what they hold (below), not by their paths.
LOCAL_PATHS = ("model_path", "train_path", "dev_path", "test_path", "metrics_file", "save_dir", "export_dir",
               "resume", "lora_path")
# Command-line arguments that may differ between ranks (--json: only rank 0 writes it).
RANK_LOCAL_ARGS = ("config_file", "world", "rank", "init_method", "local_rank", "check", "json",
                   "prompts", "out", "predict")     # inference's files: their contents are compared instead
MODEL_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "intermediate_size", "max_position_embeddings", "tie_word_embeddings")
_MISSING = "<absent>"


class Disagreement(Exception):
    """Ranks were started with different settings: a user's mistake (exit status 2)."""


class RendezvousError(Exception):
    """The rendezvous itself failed: port in use, a rank that never came (exit status 1)."""


def _digest(items) -> str:
    h = hashlib.sha256()
    for item in items:
        h.update(repr(item).encode("utf-8", "surrogatepass"))
    return h.hexdigest()[:16]


def fingerprint(cfg, job, args, script: str) -> dict:
    """What every rank must agree on, as an ordered {key: JSON value}."""
    out = {"--world": args.world, "script": script}
    for f in dataclasses.fields(cfg):
        if not f.name.startswith("_") and f.name not in LOCAL_PATHS:
            out[f.name] = getattr(cfg, f.name)
    for key, value in sorted(vars(args).items()):
        if key not in RANK_LOCAL_ARGS:
            out[f"--{key}"] = value
    try:
        with open(os.path.join(cfg.model_path, "config.json"), encoding="utf-8") as f:
            model = json.load(f)
        out.update({f"model_path config.json {k}": model.get(k, _MISSING) for k in MODEL_KEYS})
    except (OSError, ValueError):
        pass                      # validate_for_world read it already; nothing to add
    task = getattr(job, "task", None)
    if task is not None:
        out["training examples"] = len(task.train_set)
        out["training data (digest)"] = _digest(task.train_set)
        out["class names"] = task.class_names
    requests = getattr(job, "requests", None)        # an inference job's tokenised prompts
    if requests is not None:
        out["prompts (digest)"] = _digest(requests)
    tokenizer = getattr(job, "tokenizer", None)
    if tokenizer is not None:
        out["tokenizer size"] = len(tokenizer)
    if hasattr(job, "resume"):
        out["resume checkpoint step"] = job.resume.step if job.resume is not None else None
    return json.loads(json.dumps(out, default=str))        # what another rank will read back


def _show(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def compare(lead: dict, other: dict, rank: int) -> str | None:
    """The line naming the first difference between rank 0's fingerprint and rank `rank`'s."""
    if lead.get("--world") != other.get("--world"):
        return (f"ranks disagree on the world size: rank 0 has --world {lead.get('--world')}, rank {rank} has "
                f"--world {other.get('--world')}; start every rank with the same --world")
    for key in list(lead) + [k for k in other if k not in lead]:
        a, b = lead.get(key, _MISSING), other.get(key, _MISSING)
        if a != b:
            return (f"rank {rank}'s settings differ from rank 0's at {key}: {_show(a)} on rank 0, {_show(b)} on "
                    f"rank {rank}; start every rank with the same config and arguments")
    return None


def open_store(init_method: str, rank: int, world: int, timeout: timedelta):
    """The store of the rendezvous at init_method (tcp://, env:// or file://)."""
    if not init_method.startswith("tcp://"):
        store, _, _ = next(dist.rendezvous(init_method, rank, world, timeout=timeout))
        store.set_timeout(timeout)
        return store
    url = urlparse(init_method)
    try:
        # Rank 0 serves the store; the others connect to it (retrying until timeout).
        return dist.TCPStore(url.hostname, url.port, None, rank == 0, timeout, wait_for_workers=False)
    except dist.DistNetworkError as e:
        if rank == 0 and "EADDRINUSE" in str(e):
            raise RendezvousError(f"port {url.port} on {url.hostname} is in use (by another job?); give this job "
                                  "a free port in --init_method, the same on every rank") from None
        raise


def agree(store, rank: int, world: int, mine: dict, timeout_s: float) -> None:
    """Raise Disagreement (every rank) or RendezvousError unless every rank has the same fingerprint."""
    prefix = f"galaxy/agree/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"   # torchrun restarts
    deadline = time.monotonic() + timeout_s

    def get(key: str) -> dict | str:
        store.set_timeout(timedelta(seconds=max(0.1, deadline - time.monotonic())))
        return store.get(prefix + key).decode()

    if rank != 0:
        # A rank number claimed before means another job's rank holds it: this store is not ours.
        if store.add(f"{prefix}slot/{rank}", 1) > 1:
            raise RendezvousError(f"rank {rank} has already joined it: the port is in use by another job (or two "
                                  f"processes were given --rank {rank}); give this job a free port in --init_method")
        lead = json.loads(get("info/0"))
        store.set(f"{prefix}info/{rank}", json.dumps(mine))
        line = compare(lead, mine, rank)
        if line:            # rank 0 reads our fingerprint and reaches the same verdict
            store.add(f"{prefix}read", 1)
            raise Disagreement(line)
        verdict = get("verdict")
        store.add(f"{prefix}read", 1)
        if verdict != "ok":
            raise Disagreement(verdict)
        return
    store.set(f"{prefix}info/0", json.dumps(mine))
    line, expected = None, world
    for r in range(1, world):
        try:
            other = json.loads(get(f"info/{r}"))
        except dist.DistError:
            joined_ranks = f"ranks 0-{r - 1} did" if r > 1 else "only rank 0 did"
            raise RendezvousError(f"rank {r} did not join within timeout_s={timeout_s:g} ({joined_ranks}); start all "
                                  f"{world} ranks with the same --world and --init_method") from None
        line = compare(mine, other, r)
        if line:
            # A rank started with a larger --world has peers this rank never waits for.
            if isinstance(other.get("--world"), int):
                expected = max(expected, other["--world"])
            break
    store.set(f"{prefix}verdict", line or "ok")
    if line:
        # The store lives in this process, and a rank that connects after it exits would wait out
        # its connect timeout instead of hearing the verdict: keep it up until every rank of the
        # largest world named has read the verdict (or compared rank 0's fingerprint), within
        # timeout_s of the start.
        while store.add(f"{prefix}read", 0) < expected - 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        raise Disagreement(line)
