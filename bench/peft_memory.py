"""Full fine-tuning vs LoRA vs side-tuning on all-MiniLM-L6-v2: peak memory and step time.

Every method runs in a fresh process (peak RSS only grows within a process), serially, on the
same batch of real sentences (bench/step_time_vs_hf.make_batch; default 16 x 128 tokens), with
the checkpoint's dropout and AdamW over the method's trainable parameters. One step = zero_grad,
forward with loss, backward, AdamW step. Per method it reports:

  trainable        parameters the optimizer updates (galaxy.peft.parameter_counts)
  saved MiB        bytes autograd keeps for the backward pass in one step (saved-tensor hooks,
                   storages counted once): the activation memory a method needs
  state MiB        gradients + AdamW state (2 tensors per trainable parameter) after a step
  peak MiB         CPU: the process's peak RSS over all steps (Linux VmHWM, reset once the model
                   is built), minus the RSS of the built model: what training adds to the
                   weights. CUDA (--device cuda): torch.cuda.max_memory_allocated over the steps,
                   weights included
  step ms          median (and min) over --steps after --warmup

    HF_HUB_OFFLINE=1 .venv/bin/python bench/peft_memory.py [--methods full lora adapter side side_only]
        [--batch_size 16] [--pad_size 128] [--steps 10] [--threads 2] [--device cpu] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

MIB = 2**20


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


def saved_bytes(model, batch) -> int:
    """Bytes autograd saves for backward during one forward pass (each storage once)."""
    storages: dict[int, int] = {}

    def pack(t):
        if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter):
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = model(**batch)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(storages.values())


def run_method(args) -> dict:
    from galaxy.train.optim import build_optimizer
    from step_time_vs_hf import make_batch

    from galaxy.distributed.group import GalaxyGroup
    from galaxy.models.build import load_hf_config
    from galaxy.runtime.assemble import build_model
    from galaxy.plan import Plan
    from galaxy.peft import PeftOptions, apply_peft, parameter_counts

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    cfg = load_hf_config(args.model_dir)
    group = GalaxyGroup.serial(cfg.num_attention_heads, cfg.intermediate_size, args.pad_size)
    model = build_model(args.model_dir, Plan(), group, num_labels=4, seed=0, device=device)
    trainable = apply_peft(model, PeftOptions(args.child, side_reduction_factor=args.side_reduction_factor),
                           seed=0)
    model.train()
    batch = {k: v.to(device) for k, v in make_batch(args.model_dir, args.batch_size, args.pad_size).items()}
    opt = build_optimizer("adamw", trainable.values(), lr=1e-5)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    else:   # the built model; every step from here on counts toward the peak
        base, reset = _status_kib("VmRSS") * 1024, _reset_peak_rss()
    saved = saved_bytes(model, batch)

    def step() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(**batch)[1].backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    for _ in range(args.warmup):
        step()
    times = [step() for _ in range(args.steps)]
    if device.type == "cuda":
        peak, what = torch.cuda.max_memory_allocated(device), "max_memory_allocated (weights included)"
    else:
        hwm = _status_kib("VmHWM") * 1024
        peak, what = hwm - base, "peak RSS over the built model" if reset else "process peak RSS - model RSS (no reset)"
    state = sum(p.numel() * p.element_size() for p in trainable.values()) * 3   # grad + exp_avg + exp_avg_sq
    n_train, n_total = parameter_counts(model)
    return {"method": args.child, "trainable": n_train, "total": n_total, "saved_mib": saved / MIB,
            "state_mib": state / MIB, "peak_mib": peak / MIB, "peak_is": what, "base_mib": base / MIB,
            "median_ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3,
            "description": model.attached.peft.description}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model_dir", default=str(ROOT / "models" / "all-MiniLM-L6-v2"))
    ap.add_argument("--methods", nargs="+", default=["full", "lora", "adapter", "side", "side_only"])
    ap.add_argument("--batch_size", type=int, default=16)
    ap.add_argument("--pad_size", type=int, default=128)
    ap.add_argument("--side_reduction_factor", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(run_method(args)))
        return

    rows = []
    for method in args.methods:
        cmd = [sys.executable, __file__, "--child", method] + [
            a for k, v in vars(args).items() if k not in ("methods", "json", "child")
            for a in (f"--{k}", str(v))]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"all-MiniLM-L6-v2, batch {args.batch_size} x {args.pad_size}, {args.device}, threads "
          f"{args.threads}, AdamW, median of {args.steps} steps after {args.warmup}; peak = {rows[0]['peak_is']}")
    print(f"{'method':>10} | {'trainable':>11} {'%':>6} | {'saved MiB':>9} {'state MiB':>9} {'peak MiB':>9} "
          f"{'vs full':>7} | {'step ms':>8} {'min ms':>8} {'vs full':>7}")
    full = next((r for r in rows if r["method"] == "full"), rows[0])
    for r in rows:
        print(f"{r['method']:>10} | {r['trainable']:>11,} {100 * r['trainable'] / r['total']:>5.2f}% | "
              f"{r['saved_mib']:>9.1f} {r['state_mib']:>9.1f} {r['peak_mib']:>9.1f} "
              f"{r['peak_mib'] / full['peak_mib']:>7.2f} | {r['median_ms']:>8.1f} {r['min_ms']:>8.1f} "
              f"{r['median_ms'] / full['median_ms']:>7.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
