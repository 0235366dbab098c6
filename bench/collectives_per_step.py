"""Collectives one rank issues per training step, per plan, before and after a change.

Every torch.distributed call a training step makes is counted, whatever issues it (Galaxy's
transitions, the gradient sync, DDP's buckets, the loss and token reductions, clipping, a
pipeline's sends and receives): the counting wraps the torch.distributed functions themselves
before galaxy is imported, so two revisions are counted the same way. One step is what the
trainer does per optimizer step (Trainer.train_step: runner.step, optional clipping, AdamW; then
Trainer.global_tokens), on all-MiniLM-L6-v2 with a 4-class head at world 2 over gloo.

Plans (world 2):
  tp        ATT TP, MLP TP, CON None                         (pretrain_tp_bert.py)
  sp        ATT SP, MLP SP, CON SP                           (pretrain_sp_bert.py)
  megatron  ATT TP, MLP TP, CON SP, even shares              (the galaxy preset's default shares)
  galaxy    ATT TP, MLP TP, CON SP, uneven shares 7:5        (heads, MLP columns and tokens)
  dp        DDP over 2 replicas of the whole model           (pretrain_dp_bert.py)
  pp        2 pipeline stages, 2 micro-batches               (pretrain_pp_bert.py)

"Before" is another revision of the repository (default: where this branch left main), exported
with `git archive` into a temporary folder and imported from there; "after" is this checkout.
Counts are of the last of --steps steps (the gradient sync starts its buckets during backward
from the second step on); the first step's are in the JSON.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/collectives_per_step.py [--before REV] [--plans tp sp ...]
        [--steps 3] [--batch 2] [--pad 128] [--clip_grad 1.0] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tarfile
import tempfile
from collections import Counter
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "all-MiniLM-L6-v2"
PLANS = {
    "tp": ("tp", {}),
    "sp": ("sp", {}),
    "megatron": ("galaxy", {}),
    "galaxy": ("galaxy", {"tp_num_attention_heads_list": [7, 5], "tp_intermediate_size_list": [896, 640],
                          "seq_scatter_list": [74, 54]}),
    "dp": ("dp", {"dp_deg": 2}),
    "pp": ("pp", {"pp_deg": 2, "num_microbatches": 2}),
}
COUNTED = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather_single",
           "reduce_scatter_single", "broadcast", "all_gather", "all_gather_object", "broadcast_object_list",
           "reduce_scatter", "all_to_all_single", "send", "recv", "isend", "irecv",
           "barrier", "gather", "scatter", "reduce")
KIND = {"all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather",
        "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
        "send": "p2p", "recv": "p2p", "isend": "p2p", "irecv": "p2p"}


def install_counter(counts: dict) -> None:
    """Wrap torch.distributed's functions: each call adds 1 to counts['now'][kind] while counting."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    def wrap(name, fn):
        def counted(*args, **kwargs):
            if counts.get("now") is not None:
                counts["now"][KIND.get(name, name)] += 1
            return fn(*args, **kwargs)
        return counted
    for name in COUNTED:
        if hasattr(dist, name):
            wrapped = wrap(name, getattr(dist, name))
            setattr(dist, name, wrapped)
            if name in ("isend", "irecv"):     # P2POp checks its op against c10d's own names
                setattr(c10d, name, wrapped)


def workspace(root: str) -> dict:
    """Training data (pydoc topics, 4 classes) for the trainer; nothing else is read."""
    from galaxy.data import pydoc_topics_dataset
    examples, names = pydoc_topics_dataset("train")
    classes = sorted({names[label] for _, label in examples})[:4]
    path = os.path.join(root, "train.tsv")
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(f"{text}\t{names[label]}\n" for text, label in examples if names[label] in classes)
    return {"train": path, "classes": classes}


def count_on_rank(rank: int, port: int, src: str, plan: str, args, out) -> None:
    try:
        _count_on_rank(rank, port, src, plan, args, out)
    except BaseException:
        import traceback
        out.put((rank, traceback.format_exc()))
        raise


def _count_on_rank(rank: int, port: int, src: str, plan: str, args, out) -> None:
    sys.path.insert(0, src)
    import torch
    import torch.distributed as dist
    counts: dict = {"now": None}
    install_counter(counts)            # before galaxy binds any torch.distributed function
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from galaxy.config import apply_preset, load_config, validate_for_world
    from galaxy.launch import DistEnv
    from galaxy.models.shape import read_model_shape
    from galaxy.train.trainer import ClassifierTrainer, prepare_classifier
    with tempfile.TemporaryDirectory() as tmp:
        ws = workspace(tmp) if rank == 0 else None
        box = [ws]
        dist.broadcast_object_list(box)
        ws = box[0]
        preset, keys = PLANS[plan]
        cfg = dict(model_path=str(MODEL), train_path=ws["train"], class_list=ws["classes"],
                   pad_size=args.pad, batch_size=args.batch, learning_rate=1e-4, optimizer="adamw",
                   clip_grad=args.clip_grad, timeout_s=120, **keys)
        path = os.path.join(tmp, f"{plan}-{rank}.json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        cfg = apply_preset(load_config(path), preset, world=2)
        validate_for_world(cfg, 2, rank, read_model_shape(cfg.model_path))
        env = DistEnv(rank=rank, world=2, backend="gloo", device=torch.device("cpu"), timeout_s=cfg.timeout_s,
                      local_rank=rank, launch_rank=rank)
        trainer = ClassifierTrainer(prepare_classifier(cfg), env)
        steps = []
        batches = iter(trainer.batches)
        for k in range(1, args.steps + 1):
            batch = next(batches)
            counts["now"] = Counter()
            trainer.train_step(batch, k)
            trainer.global_tokens(batch)
            steps.append(dict(counts["now"]))
            counts["now"] = None
        dist.barrier()
    out.put((rank, steps))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def count(src: str, plan: str, args) -> list[dict]:
    """Per-step counts of rank 0 (rank 1's must be the same), from a fresh world of 2."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=count_on_rank, args=(r, port, src, plan, args, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=1800) for _ in procs)
    for r, res in results.items():
        if isinstance(res, str):
            raise RuntimeError(f"{plan}, rank {r}:\n{res}")
    for p in procs:
        p.join()
    if plan != "pp" and results[0] != results[1]:     # pipeline stages differ (sends vs receives)
        raise RuntimeError(f"{plan}: ranks issued different collectives: {results}")
    if plan == "pp":    # per stage: what each stage issues, side by side
        return [{f"{k} (stage {r})": v for r in (0, 1) for k, v in results[r][i].items()}
                for i in range(len(results[0]))]
    return results[0]


def export(rev: str, dest: str) -> str:
    """The repository at `rev` (galaxy/ only) under dest; the models come from this checkout."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "galaxy"], check=True,
                             capture_output=True).stdout
    tar_path = os.path.join(dest, "src.tar")
    with open(tar_path, "wb") as f:
        f.write(archive)
    with tarfile.open(tar_path) as t:
        t.extractall(dest, filter="data")
    return dest


def fmt(c: dict) -> str:
    return f"{sum(c.values()):3d}  " + ", ".join(f"{k} {v}" for k, v in sorted(c.items()))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", default=None, help="revision to compare with (default: merge-base with main)")
    ap.add_argument("--plans", nargs="+", default=list(PLANS), choices=list(PLANS))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--pad", type=int, default=128)
    ap.add_argument("--clip_grad", type=float, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    before = args.before or subprocess.run(["git", "-C", str(ROOT), "merge-base", "HEAD", "main"], check=True,
                                           capture_output=True, text=True).stdout.strip()
    result = {"before_rev": before, "args": vars(args), "plans": {}}
    with tempfile.TemporaryDirectory() as tmp:
        old_src = export(before, tmp)
        for plan in args.plans:
            result["plans"][plan] = {"before": count(old_src, plan, args), "after": count(str(ROOT), plan, args)}
            r = result["plans"][plan]
            print(f"{plan:9s} before {fmt(r['before'][-1])}\n{'':9s} after  {fmt(r['after'][-1])}", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
