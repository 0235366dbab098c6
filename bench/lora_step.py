"""What a LoRA step costs: galaxy against peft, and against full fine-tuning of the same plan.

serial    one process: a LoRA training step (zero_grad, forward with the loss, backward, AdamW over
          the trainable parameters) of galaxy's model against peft's LoRA on Hugging Face's model,
          side by side: all-MiniLM-L6-v2 (classification, 4 classes) and a random Llama (causal LM,
          --llama_hidden wide, --llama_layers layers, written under --out). Both start from one
          peft adapter directory (random non-zero A and B, and the classifier), so the weights are
          the same; same targets, rank, batch, dropout (0: the loss check is exact), threads.
          --rounds rounds of --steps pairs of steps, BERT's and Llama's rounds taking turns; within
          a pair the sides alternate who goes first. Target: galaxy / peft <= 1.0, read as the
          median of the paired ratios (each galaxy step over the peft step beside it), printed
          with their quartiles and each round's median: "met in every round" when no round's
          median is over. Also counted, load-independent: each side's GEMM calls and GFLOPs
          per forward and backward (torch.profiler); with --ops N, each side's operator table
          over N more steps of each (interleaved): calls per step and share of the step's
          operator self time, printed where the two sides differ. --cpu_allocator keep gives
          this process what galaxy's trainer does by default (galaxy.runtime.cpu_allocator: freed
          memory stays mapped), for both sides alike: without it each step's big tensors (the
          [tokens, vocab] logits and their gradients, 32 MB each for Llama) land on fresh pages
          0-38k times a step, 0-150 MB of page faults that fall on either side by chance.
galaxy2   world 2 under the Galaxy preset (even shares; pinned with --pin, or on the edge testbed's
          --cluster FILE): pretrain_galaxy.py on all-MiniLM-L6-v2 with use_lora, and with full
          fine-tuning, same plan, batch and data;
          with --batch_streams N (each value in turn: the same plan for both methods); --rounds
          rounds of one run each, who goes first alternating; each run's median step after the
          first. Target: LoRA / full <= 0.8, read as the median of the rounds' ratios (printed
          with each round's), and the least disturbed runs' ratio beside it.

Prints every figure and the two ratios, and writes --out/results.json.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/lora_step.py [--parts serial galaxy2] [--threads 1] [--steps 8]
        [--batch_size 8] [--pad_size 128] [--lora_dim 8] [--rounds 3] [--batch_streams 1 2] [--pin]
        [--cluster FILE] [--ops 4]
        [--cpu_allocator keep]
        [--out runs/bench/lora_step]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

MINILM = ROOT / "models" / "all-MiniLM-L6-v2"
NUM_LABELS = 4
SERIAL_TARGET, GALAXY_TARGET = 1.0, 0.8


def write_llama(folder: Path, hidden: int, layers: int, vocab: int = 8000) -> str:
    """A random LlamaForCausalLM (grouped-query attention, untied head) written as a model folder."""
    from transformers import LlamaConfig, LlamaForCausalLM
    path = folder / f"llama-{hidden}x{layers}"
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        heads = hidden // 64
        cfg = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64, num_hidden_layers=layers,
                          num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), vocab_size=vocab,
                          max_position_embeddings=1024, tie_word_embeddings=False)
        LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


def hf_model(family: str, path: str):
    from transformers import BertForSequenceClassification, LlamaForCausalLM
    if family == "bert":
        return BertForSequenceClassification.from_pretrained(path, num_labels=NUM_LABELS, hidden_dropout_prob=0.0,
                                                             attention_probs_dropout_prob=0.0)
    return LlamaForCausalLM.from_pretrained(path)


def write_adapter(family: str, path: str, out: Path, targets, r: int) -> str:
    """A peft adapter with random non-zero A and B (and the classifier): both models load it."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(1)
    task = "SEQ_CLS" if family == "bert" else "CAUSAL_LM"
    model = get_peft_model(hf_model(family, path), LoraConfig(task_type=task, r=r, lora_alpha=2 * r,
                                                               target_modules=list(targets)))
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(0.05 * torch.randn_like(p))
    folder = out / f"adapter-{family}"
    model.save_pretrained(folder)
    return str(folder)


def pair(family: str, path: str, adapter: str, pad: int):
    """(galaxy's model, peft's model), both in train() with the adapter loaded and dropout off."""
    from peft import PeftModel

    from galaxy.distributed.group import GalaxyGroup
    from galaxy.models.build import load_hf_config
    from galaxy.peft import PeftOptions, apply_peft
    from galaxy.plan import Plan
    from galaxy.runtime.assemble import build_model
    cfg = load_hf_config(path, 0.0)
    group = GalaxyGroup.serial(cfg.num_attention_heads, cfg.intermediate_size, pad)
    ours = build_model(path, Plan(), group, num_labels=NUM_LABELS if family == "bert" else None, dropout=0.0)
    apply_peft(ours, PeftOptions("lora", lora_path=adapter))
    theirs = PeftModel.from_pretrained(hf_model(family, path), adapter, is_trainable=True)
    return ours.train(), theirs.train()


def batch_for(family: str, path: str, rows: int, pad: int) -> dict:
    if family == "bert":
        from step_time_vs_hf import make_batch
        return make_batch(path, rows, pad)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 8000, (rows, pad), generator=gen)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


GEMMS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm")


def step_work(model, loss_fn, batch) -> dict:
    """What one forward and backward asks of the CPU, counted by torch.profiler (the same on a busy
    machine as on a quiet one): GEMM calls and their GFLOPs. Equal counts mean a time gap is the
    kernels' or the machine's, not extra work (weight gradients of frozen weights would add GEMMs)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        loss_fn(model, batch).backward()
    events = [e for e in prof.key_averages() if e.key in GEMMS]
    model.zero_grad(set_to_none=True)
    return {"gemm_calls": sum(e.count for e in events), "gemm_gflops": sum(e.flops for e in events) / 1e9}


def op_tables(fns: dict, opts: dict, batch, steps: int) -> dict:
    """{side: {op: [calls per step, share of the step's operator self time]}} over `steps` training
    steps of each side, alternating. Shares and counts mean the same on a loaded machine as on a
    quiet one; the milliseconds do not, so they are left out."""
    from step_time_vs_hf import step
    from torch.profiler import ProfilerActivity, profile
    totals = {k: {} for k in fns}
    for i in range(steps):
        for k in (("galaxy", "peft") if i % 2 == 0 else ("peft", "galaxy")):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                step(*fns[k], opts[k], batch)
            for e in prof.key_averages():
                calls, self_us = totals[k].get(e.key, (0, 0.0))
                totals[k][e.key] = (calls + e.count, self_us + e.self_cpu_time_total)
    tables = {}
    for k, ops in totals.items():
        whole = sum(us for _, us in ops.values()) or 1.0
        tables[k] = {op: [calls / steps, us / whole] for op, (calls, us) in ops.items()}
    return tables


def print_op_differences(family: str, tables: dict, min_share: float = 0.002) -> None:
    """The operators whose calls differ, or whose share differs by min_share or more."""
    g, p = tables["galaxy"], tables["peft"]
    rows = [(op, g.get(op, [0, 0.0]), p.get(op, [0, 0.0])) for op in set(g) | set(p)]
    rows = [r for r in rows if r[1][0] != r[2][0] or abs(r[1][1] - r[2][1]) >= min_share]
    print(f"serial {family}: operators that differ (calls per step galaxy / peft, share of self time)")
    for op, (gc, gs), (pc, ps) in sorted(rows, key=lambda r: -max(r[1][1], r[2][1]))[:30]:
        print(f"    {op[:60]:60s} {gc:6.0f} / {pc:<6.0f} {100 * gs:6.2f}% / {100 * ps:.2f}%")


def serial_setup(family: str, path: str, args, out: Path) -> dict:
    """Both sides of one model, checked and warmed up: {"fns", "opts", "batch", and the figures
    that do not depend on load (loss, GEMM work, trainable parameters)}."""
    from step_time_vs_hf import step

    from galaxy.train.optim import build_optimizer
    targets = ("query", "value") if family == "bert" else ("q_proj", "v_proj")
    adapter = write_adapter(family, path, out, targets, args.lora_dim)
    ours, theirs = pair(family, path, adapter, args.pad_size)
    batch = batch_for(family, path, args.batch_size, args.pad_size)
    if family != "bert":
        batch = {k: v for k, v in batch.items() if k != "token_type_ids"}
    fns = {"galaxy": (ours, lambda m, b: m(**b)[1]), "peft": (theirs, lambda m, b: m(**b).loss)}
    with torch.no_grad():
        losses = {k: fn(m, batch).item() for k, (m, fn) in fns.items()}
    if abs(losses["galaxy"] - losses["peft"]) > 1e-5 * abs(losses["peft"]):   # not the same computation
        raise SystemExit(f"{family}: galaxy's loss {losses['galaxy']} differs from peft's {losses['peft']}")
    work = {k: step_work(m, fn, batch) for k, (m, fn) in fns.items()}
    opts = {k: build_optimizer("adamw", m.parameters(), lr=1e-5) for k, (m, _) in fns.items()}
    trainable = {k: sum(p.numel() for p in m.parameters() if p.requires_grad) for k, (m, _) in fns.items()}
    for _ in range(args.warmup):
        for k, (m, fn) in fns.items():
            step(m, fn, opts[k], batch)
    return {"fns": fns, "opts": opts, "batch": batch, "model": path, "targets": list(targets),
            "trainable": trainable, "loss": losses, "work": work}


def serial_round(setup: dict, steps: int) -> dict:
    """`steps` pairs of steps, the sides alternating who goes first: {side: [seconds]}."""
    from step_time_vs_hf import step
    times = {"galaxy": [], "peft": []}
    for i in range(steps):
        for k in (("galaxy", "peft") if i % 2 == 0 else ("peft", "galaxy")):
            times[k].append(step(*setup["fns"][k], setup["opts"][k], setup["batch"]))
    return times


def paired_summary(rounds: list[dict]) -> dict:
    """Each galaxy step over the peft step beside it (the load that slowed one slowed both):
    the median of all those ratios, their quartiles, each round's median, and the medians of
    the step times."""
    ratios = [g / p for r in rounds for g, p in zip(r["galaxy"], r["peft"])]
    per_round = [statistics.median(g / p for g, p in zip(r["galaxy"], r["peft"])) for r in rounds]
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    med = {k: statistics.median(t for r in rounds for t in r[k]) for k in ("galaxy", "peft")}
    return {"paired_ratio": statistics.median(ratios), "paired_quartiles": [q1, q3], "round_ratios": per_round,
            "median_s": med, "ratio": med["galaxy"] / med["peft"]}


def serial_rounds(setups: dict, args) -> dict:
    """--rounds rounds of --steps pairs, the families taking turns (BERT, Llama; Llama, BERT; ...),
    so that a change of load falls on both families and both sides."""
    rounds = {family: [] for family in setups}
    for r in range(args.rounds):
        for family in (list(setups) if r % 2 == 0 else list(setups)[::-1]):
            rounds[family].append(serial_round(setups[family], args.steps))
    out = {}
    for family, setup in setups.items():
        summary = paired_summary(rounds[family])
        ops = op_tables(setup["fns"], setup["opts"], setup["batch"], args.ops) if args.ops else None
        keep = {k: setup[k] for k in ("model", "targets", "trainable", "loss", "work")}
        out[family] = {**keep, **summary, "times_s": rounds[family], "ops": ops}
    return out


def galaxy_world2(args, out: Path, streams: int) -> dict:
    """pretrain_galaxy.py at world 2 (Galaxy preset, even shares, `streams` batch streams): LoRA
    against full fine-tuning of the same plan, one of each per round, who goes first alternating.
    Each run's figure is its median step after the first; the paired ratio is each round's LoRA
    over that round's full run, the median over the rounds (and their range)."""
    from planning_runs import train, write_base
    folder = out / f"galaxy2-s{streams}"
    base = write_base(folder, pad_size=args.pad_size, batch_size=args.batch_size, steps=args.train_steps,
                      batch_streams=streams)
    cores = [0, 1] if args.pin else [None, None]
    runs = {"lora": [], "full": []}
    lora = {"use_lora": True, "lora_dim": args.lora_dim, "lora_alpha": 2 * args.lora_dim}
    for r in range(args.rounds):
        for name in (("full", "lora") if r % 2 == 0 else ("lora", "full")):
            keys = lora if name == "lora" else {}
            runs[name].append(train(folder, base, name, keys, 2, cores))
    ratios = [a["step_s"] / b["step_s"] for a, b in zip(runs["lora"], runs["full"])]
    best = {k: min(g["step_s"] for g in v) for k, v in runs.items()}
    return {"batch_streams": streams, "step_s": best, "best_ratio": best["lora"] / best["full"],
            "paired_ratio": statistics.median(ratios), "round_ratios": ratios, "runs": runs,
            "peak_mib": {k: v[-1]["peak_mib"] for k, v in runs.items()}}


def print_serial(family: str, r: dict, args) -> None:
    q1, q3 = r["paired_quartiles"]
    verdict = ("met in every round" if max(r["round_ratios"]) <= SERIAL_TARGET else
               "met by the median" if r["paired_ratio"] <= SERIAL_TARGET else "missed")
    print(f"serial {family} ({Path(r['model']).name}, LoRA r {args.lora_dim} on {', '.join(r['targets'])}, "
          f"{r['trainable']['galaxy']:,} / {r['trainable']['peft']:,} trainable, threads {args.threads}): "
          f"loss {r['loss']['galaxy']:.7f} / {r['loss']['peft']:.7f}; GEMMs per forward+backward "
          + " / ".join(f"{w['gemm_calls']} ({w['gemm_gflops']:.2f} GFLOP)" for w in r["work"].values())
          + f"; median step galaxy {r['median_s']['galaxy'] * 1e3:.1f} ms, peft {r['median_s']['peft'] * 1e3:.1f} ms"
          f"\n    paired galaxy / peft {r['paired_ratio']:.3f}x (quartiles {q1:.3f}-{q3:.3f}; rounds "
          + " ".join(f"{x:.3f}" for x in r["round_ratios"])
          + f"): target <= {SERIAL_TARGET} {verdict}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", nargs="+", choices=("serial", "galaxy2"), default=["serial", "galaxy2"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=8, help="serial: pairs of steps per round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--pad_size", type=int, default=128)
    p.add_argument("--lora_dim", type=int, default=8)
    p.add_argument("--llama_hidden", type=int, default=512)
    p.add_argument("--llama_layers", type=int, default=4)
    p.add_argument("--ops", type=int, default=0, help="serial: operator tables over this many more steps of each")
    p.add_argument("--cpu_allocator", choices=("system", "keep"), default="system",
                   help="serial: keep = glibc keeps freed memory mapped (the trainer's default), both sides")
    p.add_argument("--rounds", type=int, default=3, help="serial: rounds of --steps pairs; world 2: runs of each")
    p.add_argument("--batch_streams", type=int, nargs="+", default=[1], help="world 2: each value in turn")
    p.add_argument("--train_steps", type=int, default=8, help="steps of each world-2 run")
    p.add_argument("--pin", action="store_true", help="world 2: rank r on core r (taskset)")
    p.add_argument("--cluster", help="world 2: run on the edge testbed's cluster FILE (two devices)")
    p.add_argument("--out", default="runs/bench/lora_step")
    args = p.parse_args()
    if args.cluster:
        from planning_runs import use_cluster
        use_cluster(args.cluster)
    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    if args.cpu_allocator == "keep":
        from galaxy.runtime.cpu_allocator import keep_freed_memory
        keep_freed_memory()
    results = {"args": vars(args), "torch": torch.__version__, "load": os.getloadavg()}
    if "serial" in args.parts:
        llama = write_llama(out, args.llama_hidden, args.llama_layers)
        setups = {family: serial_setup(family, path, args, out) for family, path in
                  (("bert", str(MINILM)), ("llama", llama))}
        for family, r in serial_rounds(setups, args).items():
            results[f"serial_{family}"] = r
            print_serial(family, r, args)
            if r["ops"]:
                print_op_differences(family, r["ops"])
    if "galaxy2" in args.parts:
        for streams in args.batch_streams:
            r = results[f"galaxy2_s{streams}"] = galaxy_world2(args, out, streams)
            print(f"world 2, Galaxy preset, batch_streams {streams}: LoRA {r['step_s']['lora'] * 1e3:.1f} ms, full "
                  f"{r['step_s']['full'] * 1e3:.1f} ms per step (best runs: {r['best_ratio']:.3f}x); paired "
                  f"LoRA / full {r['paired_ratio']:.3f}x (rounds {' '.join(f'{x:.3f}' for x in r['round_ratios'])}; "
                  f"target <= {GALAXY_TARGET}); peak MiB per rank LoRA {r['peak_mib']['lora']}, "
                  f"full {r['peak_mib']['full']}", flush=True)
    results["load_after"] = os.getloadavg()
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {out / 'results.json'} (load average {results['load']} -> {results['load_after']})")


if __name__ == "__main__":
    main()
