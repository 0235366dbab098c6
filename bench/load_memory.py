"""Peak memory of building one rank's model: full checkpoint read vs sharded read.

For each model and each rank's view, two builds, each in a fresh process (peak RSS only grows
within a process):

  full read     the old path (tests/support/full_read_reference.py): the full model materialised, the
                whole checkpoint read and copied in, then the plan slices and the stage prunes
  sharded read  galaxy.models.build.build_model: plan and stage applied on the meta device,
                then each kept parameter reads only its own slice of the checkpoint

Views: rank 0 of a world-2 Galaxy group (preset `galaxy`, even shares: half the heads and MLP
columns) and stage 0 of a 2-stage pipeline (first half of the layers and the embeddings).
Models: all-MiniLM-L6-v2 (models/all-MiniLM-L6-v2, 90 MB of fp32 weights, half of it the
replicated word embeddings) and a synthetic Llama written to a temporary folder as a sharded
safetensors checkpoint (*.index.json; default 400 MB of fp32 weights: hidden 1024, 6 layers,
16 query / 4 K/V heads, MLP 2816, vocabulary 16000, untied).

Per build: kept MiB (the parameters the rank ends with, the floor for any loader); added peak
MiB, the process's peak RSS during the build (Linux VmHWM, reset just before it) minus its RSS
before: what building adds to the interpreter and libraries (about 370 MiB: torch, transformers,
galaxy); peak RSS MiB, that peak itself (libraries included); build seconds. Ratios are
full / sharded. (ru_maxrss would not do: it keeps the parent's peak across fork and exec.)

    HF_HUB_OFFLINE=1 .venv/bin/python bench/load_memory.py [--models minilm llama] [--json out.json]
        [--llama_layers 6] [--llama_hidden 1024] [--llama_vocab 16000]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20
VIEWS = ("galaxy2 rank 0", "pp2 stage 0")
VARIANTS = ("full", "sharded")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _reset_peak_rss() -> bool:
    """Linux: writing 5 to clear_refs resets the peak RSS (VmHWM) to the current RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def build_once(model_dir: str, view: str, variant: str) -> dict:
    """In a fresh process: build one rank's model one way; memory figures in bytes."""
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    import torch
    from support.full_read_reference import full_read_build

    from galaxy.distributed.group import GalaxyGroup
    from galaxy.models.build import load_hf_config
    from galaxy.runtime.assemble import build_model
    from galaxy.plan import Plan

    cfg = load_hf_config(model_dir)
    heads, inter, layers = cfg.num_attention_heads, cfg.intermediate_size, cfg.num_hidden_layers
    num_labels = 4 if cfg.model_type == "bert" else None
    if view == "galaxy2 rank 0":     # rank 0 of 2, even shares; building never communicates
        plan, stage = Plan.preset("galaxy"), None
        group = GalaxyGroup(0, 2, None, (heads // 2,) * 2, (inter // 2,) * 2, (64, 64))
    else:                            # stage 0 of 2: the embeddings and the first half of the layers
        plan, stage = Plan(), (range(0, layers // 2), True, False)
        group = GalaxyGroup.serial(heads, inter, 128)
    build = full_read_build if variant == "full" else build_model
    if not _reset_peak_rss():
        raise RuntimeError("needs Linux /proc/self/clear_refs to reset the peak RSS")
    before = _status_kib("VmRSS") * 1024
    start = time.perf_counter()
    model = build(model_dir, plan, group, num_labels=num_labels, seed=0, stage=stage)
    seconds = time.perf_counter() - start
    peak = _status_kib("VmHWM") * 1024
    kept = sum(p.numel() * p.element_size() for p in model.parameters())
    digest = hashlib.sha256()                  # of every kept byte: the two builds must agree
    for name, p in model.named_parameters():
        digest.update(name.encode())
        digest.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    checksum = digest.hexdigest()
    return {"kept": kept, "before": before, "peak": peak, "seconds": seconds, "checksum": checksum,
            "torch_threads": torch.get_num_threads()}


def run_child(model_dir: str, view: str, variant: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", json.dumps([model_dir, view, variant])],
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{view} / {variant} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def write_synthetic_llama(path: str, layers: int, hidden: int, vocab: int) -> str:
    """A randomly initialised Llama as sharded safetensors (100 MB files and an index)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                      num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4,
                      max_position_embeddings=512, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(path, max_shard_size="100MB")
    return path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["minilm", "llama"], choices=["minilm", "llama"])
    ap.add_argument("--minilm_dir", default=str(ROOT / "models" / "all-MiniLM-L6-v2"))
    ap.add_argument("--llama_layers", type=int, default=6)
    ap.add_argument("--llama_hidden", type=int, default=1024)
    ap.add_argument("--llama_vocab", type=int, default=16000)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(build_once(*json.loads(args.child))))
        return

    tmp = tempfile.mkdtemp(prefix="galaxy_load_memory_")
    try:
        dirs = {"minilm": args.minilm_dir}
        if "llama" in args.models:
            dirs["llama"] = write_synthetic_llama(os.path.join(tmp, "llama"), args.llama_layers,
                                                  args.llama_hidden, args.llama_vocab)
        results = []
        for name in args.models:
            ckpt_bytes = sum(f.stat().st_size for f in Path(dirs[name]).iterdir()
                             if f.suffix in (".safetensors", ".bin"))
            for view in VIEWS:
                runs = {variant: run_child(dirs[name], view, variant) for variant in VARIANTS}
                full, sharded = runs["full"], runs["sharded"]
                if (full["checksum"], full["kept"]) != (sharded["checksum"], sharded["kept"]):
                    raise RuntimeError(f"{name} / {view}: the two builds hold different parameters")
                results.append({"model": name, "checkpoint": ckpt_bytes, "view": view, **runs})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"{'model':>6} {'view':>14} | {'ckpt':>6} {'kept':>6} | {'added peak MiB':^21} | "
          f"{'peak RSS MiB':^21} | {'build s':^13}")
    print(f"{'':>6} {'':>14} | {'MiB':>6} {'MiB':>6} | {'full':>6} {'shard':>6} {'ratio':>7} | "
          f"{'full':>6} {'shard':>6} {'ratio':>7} | {'full':>6} {'shard':>6}")
    for r in results:
        f, s = r["full"], r["sharded"]
        fa, sa = f["peak"] - f["before"], s["peak"] - s["before"]
        print(f"{r['model']:>6} {r['view']:>14} | {r['checkpoint'] / MIB:6.1f} {s['kept'] / MIB:6.1f} | "
              f"{fa / MIB:6.1f} {sa / MIB:6.1f} {fa / sa:6.2f}x | {f['peak'] / MIB:6.1f} {s['peak'] / MIB:6.1f} "
              f"{f['peak'] / s['peak']:6.2f}x | {f['seconds']:6.2f} {s['seconds']:6.2f}")
    print("added peak: the build's peak RSS minus the RSS before it (libraries loaded); peak RSS: the "
          "process's, libraries included; ratio: full read / sharded read")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
