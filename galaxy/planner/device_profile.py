"""`plan.py profile-devices`: measure every rank's device and the link between them, as training runs.

Started like training (galaxy.launch: --world/--rank/--init_method or torchrun, timeout_s on the
rendezvous and every collective, a dead peer an exit 1 with one line). Every rank, at the same
time (so that ranks sharing a host contend as they will in training):

  compute     the model's own sub-blocks (galaxy.planner.harness) forward and backward at a grid
              of shares (heads, columns, tokens) and rows, and again as the config's PEFT method
              runs them (frozen weights, LoRA, adapters, the side block); one GEMM at the model's
              largest shape (the fallback rate) and on one token (a decode step's rate); the
              optimizer's step per parameter (AdamW, SGD); adding a gradient into .grad per parameter (every micro-batch after the first does)
  memory      what a rank may use (CPU: its cgroup's memory limit where one applies, as on a device
              of the edge testbed or in a container, else MemAvailable; shared by the ranks on the
              host; CUDA: the free device memory) and the RSS of a process holding training's
              modules and tokenizer, before any model exists (what every training process pays)

then, on the real process group, every collective kind a plan uses (all-gather and reduce-scatter
with even and uneven shares, padded as galaxy.distributed.collectives pads them; all-reduce;
send/receive between ranks 0 and 1) over a range of sizes, each call after a burst of compute as
a step makes it; a call's time is the slowest rank's mean (galaxy.planner.link_profile); on more
than two ranks, a send between every pair of ranks.
Rank 0 writes the cluster description (galaxy.planner.profiles) to --out.
"""
from __future__ import annotations

import socket
import statistics
import time

import torch
import torch.distributed as dist

from galaxy.config.world import target_tokens
from galaxy.models.registry import family_of
from galaxy.models.shape import read_model_shape
from galaxy.peft import PeftOptions
from galaxy.planner.encdec_bench import EncDecBench
from galaxy.planner.chunked_prefill import CHUNK_CHOICES
from galaxy.planner.decode_profile import measure_decode
from galaxy.planner.harness import KINDS, LAYER_KINDS, SubBlockBench
from galaxy.planner.method import costed_options, method_signature
from galaxy.planner.link_profile import (PAIR_SIZES, TOKEN_SIZES, link_sizes, measure_link, measure_pairs,
                                        measure_token_calls)
from galaxy.planner.profiles import LINK_KINDS, cluster, fit_link, write_json
from galaxy.preflight.tokenizer import load_tokenizer
from galaxy.runtime import cgroup, cpu_allocator
from galaxy.runtime.host_memory import available_mib, peak_rss_mib, rss_mib
from galaxy.train.optim import build_optimizer, step_kind


def unit_grid(total: int, step: int, points: int) -> list[int]:
    """About `points` shares from small to whole, multiples of step."""
    units = total // step
    if units <= points:
        return [u * step for u in range(1, units + 1)]
    fracs = [i / (points - 1) for i in range(points)]
    grid = {max(1, round(units * (f if f > 0 else 1 / 8))) * step for f in fracs}
    return sorted(grid | {total})


def rows_grid(batch: int, quick: bool) -> list[int]:
    return [batch] if quick else sorted({1, max(1, batch // 4), batch})


STATISTICS = {"median": statistics.median, "min": min, "mean": statistics.mean}
# statistic "mean": every table point keeps its rounds going until it has run this long in all.
# A device that shares its core with other work hands the core over in scheduler slices (4 ms
# ticks here), so one short call either fits in a slice or loses a whole one: its median is the
# lucky case. A time-weighted mean over a window of many slices is what a step pays on average.
MEAN_WINDOW_S, MAX_MEAN_ROUNDS = 0.1, 400


def measure_compute(bench: SubBlockBench, batch: int, *, quick: bool, repeats: int, warmup: int,
                    statistic: str = "median", kinds=KINDS, forward_only: bool = False,
                    extra_units: dict | None = None) -> dict:
    """Forward and backward seconds of every kind on a grid of shares x rows. The points are timed
    in rounds (every point once per round), so that a change in the machine's load while profiling
    shifts every point alike instead of bending the table; `statistic` of the rounds is kept
    (under "mean", each point's rounds go on until it has run MEAN_WINDOW_S in all).
    forward_only: under no_grad (nothing kept for a backward; its seconds 0), as generation runs.
    extra_units: {kind: shares timed beside its grid's}."""
    rows = rows_grid(batch, quick)
    points = 3 if quick else 5
    grid = {}
    for kind in kinds:
        total, step = bench.units[kind]
        fixed = kind == "embed" or (kind == "head" and bench.task == "classification")
        grid[kind] = [total] if fixed else sorted(set(unit_grid(total, step, points)) |
                                                  set((extra_units or {}).get(kind, ())))
    runs = {(k, u, r): bench.runner(k, u, r) for k, units in grid.items() for u in units for r in rows}
    if forward_only:
        runs = {key: _without_grad(run) for key, run in runs.items()}
    for run in runs.values():                   # first calls allocate
        for _ in range(warmup):
            run()
    times = {key: [] for key in runs}
    spent = dict.fromkeys(runs, 0.0)            # seconds each point has run (forward + backward)

    def one_round(keys) -> None:                # each point once, in order: interleaved as in a step
        for key in keys:
            t = runs[key]()
            times[key].append(t)
            spent[key] += t[0] + t[1]

    for _ in range(repeats):
        one_round(runs)
    if statistic == "mean":                     # a point that has run MEAN_WINDOW_S sits out
        for _ in range(MAX_MEAN_ROUNDS - repeats):
            due = [key for key in runs if spent[key] < MEAN_WINDOW_S]
            if not due:
                break
            one_round(due)
    pick = STATISTICS[statistic]
    kinds = {}
    for kind, units in grid.items():
        kinds[kind] = {"units": units,
                       "fwd_s": envelope([[pick([t[0] for t in times[kind, u, r]]) for r in rows] for u in units]),
                       "bwd_s": envelope([[pick([t[1] for t in times[kind, u, r]]) for r in rows] for u in units])}
    return {"rows": rows, "statistic": statistic, "kinds": kinds, **({"forward_only": True} if forward_only else {})}


def _without_grad(run):
    def forward():
        with torch.no_grad():
            return run()
    return forward


def envelope(grid: list[list[float]]) -> list[list[float]]:
    """More units or more rows never take less time: each point becomes the least time measured at
    it or at any point with at least its units and rows (a point slowed by other work on the
    machine while it was timed falls back to what a bigger point shows)."""
    out = [list(row) for row in grid]
    for i in range(len(out) - 1, -1, -1):
        for j in range(len(out[i]) - 1, -1, -1):
            later = [out[i + 1][j]] if i + 1 < len(out) else []
            later += [out[i][j + 1]] if j + 1 < len(out[i]) else []
            out[i][j] = min([out[i][j], *later])
    return out


def timed(fn, device, repeats: int, statistic: str) -> float:
    """`statistic` of `repeats` timed calls of fn, after one untimed call (the first allocates)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return STATISTICS[statistic](times)


def measure_method(cfg, num_labels, device, *, quick: bool, repeats: int, warmup: int,
                   statistic: str = "median") -> dict | None:
    """The compute table of the config's PEFT method (None under full fine-tuning): the same grid,
    on the one-layer model galaxy.peft makes (galaxy.planner.harness), with the method's signature
    (galaxy.planner.method) that says which runs it times."""
    options = PeftOptions.from_config(cfg)
    if options.method == "full":
        return None
    options = costed_options(options, family_of(read_model_shape(cfg.model_path)["model_type"]))
    bench = SubBlockBench(cfg.model_path, seq=cfg.pad_size, num_labels=num_labels, dropout=cfg.dropout,
                          device=device, seed=cfg.seed, peft=options)
    table = measure_compute(bench, cfg.batch_size, quick=quick, repeats=repeats, warmup=warmup,
                            statistic=statistic, kinds=bench.kinds)
    return {"signature": method_signature(options, bench.family), **table}


def gemm_rate(bench: SubBlockBench, batch: int, device, repeats: int, statistic: str = "median") -> float:
    """FLOPs per second of the model's largest projection (tokens x hidden -> intermediate)."""
    hf, columns = bench.hf, getattr(bench, "columns", None) or bench.hf.intermediate_size
    x = torch.randn(batch * bench.seq, hf.hidden_size, device=device)
    w = torch.randn(columns, hf.hidden_size, device=device)
    seconds = timed(lambda: torch.nn.functional.linear(x, w), device, repeats, statistic)
    return 2.0 * x.shape[0] * hf.hidden_size * columns / seconds


def decode_rate(bench: SubBlockBench, device, repeats: int, statistic: str = "median") -> float:
    """FLOPs per second of the largest projection on one token (1 x hidden -> intermediate), as a
    decode step runs it: it reads the whole weight for one row, so it runs far below gemm_rate
    (on a CPU, memory-bound)."""
    hf, columns = bench.hf, getattr(bench, "columns", None) or bench.hf.intermediate_size
    x = torch.randn(1, hf.hidden_size, device=device)
    w = torch.randn(columns, hf.hidden_size, device=device)
    seconds = timed(lambda: torch.nn.functional.linear(x, w), device, repeats, statistic)
    return 2.0 * hf.hidden_size * columns / seconds


def optimizer_rates(device, repeats: int, statistic: str = "median", numel: int = 1 << 23) -> dict:
    """Seconds per parameter of one optimizer step (built as training builds it: galaxy.train.optim),
    the two optimizers timed in alternation. 8 M parameters: with gradient and two moments 128 MiB,
    past any cache, as a model's state is (a 2 M probe, 32 MiB, ran 1.4x faster per parameter than
    all-MiniLM-L6-v2's real step)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    opts = {}
    for name in ("adamw", "sgd"):
        p = torch.nn.Parameter(torch.randn(numel, device=device))
        p.grad = torch.randn_like(p)
        opts[name] = build_optimizer(name, [p], lr=1e-4)
        opts[name].step()
    times = {name: [] for name in opts}
    for _ in range(repeats):
        for name, opt in opts.items():
            sync()
            t0 = time.perf_counter()
            opt.step()
            sync()
            times[name].append(time.perf_counter() - t0)
    return {name: STATISTICS[statistic](t) / numel for name, t in times.items()}


def accumulate_rate(device, repeats: int, statistic: str = "median", numel: int = 1 << 23) -> float:
    """Seconds per parameter of adding one micro-batch's gradient into .grad (autograd's
    AccumulateGrad, in place, for every micro-batch after the first): 8 M parameters, past any
    cache, as a model's gradients are."""
    grad, new = torch.randn(numel, device=device), torch.randn(numel, device=device)
    return timed(lambda: grad.add_(new), device, repeats, statistic) / numel


def profile_this_rank(cfg, num_labels, env, *, quick: bool, repeats: int, warmup: int,
                      statistic: str = "median", objective: str = "step") -> dict:
    """This rank's DEVICE entry (galaxy.planner.profiles); objective "latency": only what the
    latency cost model reads (latency_entry)."""
    # The baseline: a process holding what training imports (pipelines' and FSDP's modules too)
    # and the tokenizer it keeps (MiniLM's: 45 MiB; bench/results/plan_accuracy.md).
    import galaxy.parallel.sharded_dp, galaxy.pipeline.runner, galaxy.train.trainer  # noqa: F401,E401
    # Under a memory cgroup the kernel counts the cgroup's charge, which the trainer reports as the
    # peak: pages of shared libraries first loaded outside it count in RSS but not there (about
    # 100 MiB of torch's on the edge testbed), so the baseline is the charge so far.
    tokenizer = load_tokenizer(cfg.model_path)
    limited = cgroup.own_memory() if env.device.type == "cpu" else None
    baseline = 0.0 if env.device.type != "cpu" else limited.peak / 2 ** 20 if limited and limited.peak else rss_mib()
    del tokenizer
    host = socket.gethostname()
    hosts = [None] * env.world
    dist.all_gather_object(hosts, (host, env.device.type, env.device.index))
    sharing = sum(1 for h in hosts if h == (host, env.device.type, env.device.index)) if env.device.type == "cuda" \
        else sum(1 for h in hosts if h[0] == host)
    if env.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(env.device)
        memory = free / 2 ** 20 / sharing
    else:
        # the kernel holds the rank to its cgroup's limit, whatever the host has free
        memory = (limited.limit / 2 ** 20 if limited else available_mib()) / sharing
    # An encoder-decoder's sub-blocks are not timed yet (no table: its plans are costed by FLOPs
    # over the GEMM rate); its bench gives the GEMM's shape and the optimizer's parameters.
    encdec = read_model_shape(cfg.model_path).get("is_encoder_decoder")
    bench = EncDecBench(cfg.model_path, source=cfg.pad_size, target=target_tokens(cfg), dropout=cfg.dropout) \
        if encdec else SubBlockBench(cfg.model_path, seq=cfg.pad_size, num_labels=num_labels, dropout=cfg.dropout,
                                     device=env.device, seed=cfg.seed, tie_head=objective == "latency")
    dist.barrier()                      # every rank measures at the same time, as it will train
    if objective == "latency":
        return latency_entry(cfg, bench, env, host=host, threads=torch.get_num_threads(), memory=memory,
                             baseline=baseline, quick=quick, repeats=repeats, warmup=warmup, statistic=statistic)
    compute = None if encdec else _compute(cfg, num_labels, bench, env, quick=quick, repeats=repeats,
                                           warmup=warmup, statistic=statistic)
    return {"name": f"{host} rank {env.rank}", "host": host, "device": env.device.type,
            "threads": torch.get_num_threads(), "memory_mib": round(memory, 1), "baseline_mib": round(baseline, 1),
            "gemm_flops_per_s": gemm_rate(bench, cfg.batch_size, env.device, max(3, repeats), statistic),
            "decode_flops_per_s": decode_rate(bench, env.device, max(10, repeats), statistic),
            "optimizer_s_per_param": optimizer_rates(env.device, max(3, repeats), statistic),
            "optimizer_fused": step_kind("adamw", list(bench.model.parameters()), lr=1e-4) == "fused",
            "grad_accumulate_s_per_param": accumulate_rate(env.device, max(3, repeats), statistic),
            "freed_memory_kept": cpu_allocator.kept(),
            **({"compute": compute} if compute else {})}


def latency_entry(cfg, bench, env, *, host, threads, memory, baseline, statistic, **measuring) -> dict:
    """A DEVICE entry for plan.py search --objective latency, forward only at batch 1: the layer's
    sub-blocks and the embedding under no_grad at pad_size tokens (the prefill; an encoder
    classifier's whole request, with its pooler and classifier as the "head" kind), a causal LM's
    decode step's pieces with a cache of pad_size keys (galaxy.planner.decode_profile; the LM head
    on one token, the prefill's too), the GEMM and one-token rates. No backward, optimizer or
    gradient timings, no LM head over every token, no PEFT table: what a small device can hold
    (bench/README.md: the training profile of the bench Llama peaked at 1246 MiB, over home3's
    900 MiB pi)."""
    bench.model.eval()
    causal = bench.task != "classification"      # an encoder classifier: its pooler and classifier, no decode
    # a causal LM's token-indexed kinds also at every chunk size the search tries for a pipeline's
    # prefill (galaxy.planner.chunked_prefill: a pass of few tokens is dearer per token)
    chunks = {-(-cfg.pad_size // c) for c in CHUNK_CHOICES if 1 < c <= cfg.pad_size} if causal else set()
    compute = measure_compute(bench, 1, kinds=LAYER_KINDS + (("embed",) if causal else ("embed", "head")),
                              forward_only=True, statistic=statistic,
                              extra_units={k: chunks for k in ("att_sp", "mlp_sp", "con")}, **measuring)
    compute["model"] = _model_signature(cfg, bench.hf)
    decode = {"decode": {**measure_decode(bench, cfg.pad_size, STATISTICS[statistic], measuring["quick"]),
                         "statistic": statistic}} if causal else {}
    return {"name": f"{host} rank {env.rank}", "host": host, "device": env.device.type, "threads": threads,
            "memory_mib": round(memory, 1), "baseline_mib": round(baseline, 1), "objective": "latency",
            "gemm_flops_per_s": gemm_rate(bench, 1, env.device, max(3, measuring["repeats"]), statistic),
            "decode_flops_per_s": decode_rate(bench, env.device, max(10, measuring["repeats"]), statistic),
            "freed_memory_kept": cpu_allocator.kept(), "compute": compute, **decode,
            "profile_peak_mib": _peak_mib(env)}


def _peak_mib(env) -> float | None:
    """This process's peak so far: its cgroup's figure where it has one to itself (a testbed
    device), else its peak RSS; None on CUDA."""
    if env.device.type != "cpu":
        return None
    limited = cgroup.own_memory()
    peak = limited.peak / 2 ** 20 if limited and limited.peak else peak_rss_mib()
    return None if peak is None else round(peak, 1)


def _model_signature(cfg, hf) -> dict:
    return {"model_type": hf.model_type, "hidden_size": hf.hidden_size, "num_attention_heads": hf.num_attention_heads,
            "num_key_value_heads": getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            "intermediate_size": hf.intermediate_size, "vocab_size": hf.vocab_size, "pad_size": cfg.pad_size}


def _compute(cfg, num_labels, bench, env, **measuring) -> dict:
    """The compute table of the model's sub-blocks (and of the config's PEFT method)."""
    compute = measure_compute(bench, cfg.batch_size, **measuring)
    compute["model"] = _model_signature(cfg, bench.hf)
    method = measure_method(cfg, num_labels, env.device, **measuring)
    if method is not None:
        compute["peft"] = method
    return compute


def default_statistic(device, quick: bool = False) -> str:
    """"mean" on a CPU rank under a CFS quota (unless --quick: tests), else "median". A quota throttles a device in periods
    (the edge testbed's: 10 ms): a sub-block call shorter than the quota left in its period runs at
    full speed, so the median of short calls sees a faster device than a step does. On home3 the
    median profile under-predicted pipelines whose 0.35-cpu stage held two layers by 1.33x; the
    mean profile (every point timed over MEAN_WINDOW_S) by 1.12x (bench/results/plan_cluster.md)."""
    return "mean" if device.type == "cpu" and not quick and cgroup.own_cpu_quota() else "median"


def run(job, env) -> None:
    """train_fn of galaxy.launch.main for profile-devices; job: galaxy.planner.cli.DevicesJob."""
    opts = job.opts
    repeats = 1 if opts.quick else opts.repeats
    warmup = 1
    latency = opts.objective == "latency"
    mine = profile_this_rank(job.cfg, job.num_labels, env, quick=opts.quick, repeats=repeats, warmup=warmup,
                             statistic=opts.statistic or default_statistic(env.device, opts.quick),
                             objective=opts.objective)
    devices = [None] * env.world
    dist.all_gather_object(devices, mine)
    link = None
    if env.world > 1:
        measured = measure_link(env, link_sizes(opts.quick), repeats=repeats if opts.quick else max(3, repeats))
        if latency:              # a decode step's one-token calls, measured at their size
            measured += measure_token_calls(env, TOKEN_SIZES[:2] if opts.quick else TOKEN_SIZES,
                                            repeats=repeats if opts.quick else max(3, repeats))
        fit = fit_link(measured)
        link = {"backend": env.backend, "world": env.world, "fit": {k: fit[k] for k in LINK_KINDS if k in fit},
                "measured": measured}
        if env.world > 2:
            link["pairs"] = measure_pairs(env, PAIR_SIZES, repeats=max(2, repeats))
    if env.rank == 0:
        write_json(opts.out, cluster(devices, link))
        print(summary_lines(devices, link, opts.out), flush=True)
    dist.barrier()


def summary_lines(devices, link, out) -> str:
    lines = []
    for i, d in enumerate(devices):
        lines.append(f"rank {i}: {d['name']} ({d['device']}, {d['threads']} threads): GEMM "
                     f"{d['gemm_flops_per_s'] / 1e9:.1f} GFLOP/s, memory {d['memory_mib']:.0f} MiB "
                     f"(baseline {d['baseline_mib']:.0f} MiB)" +
                     (f", profile's peak {d['profile_peak_mib']:.0f} MiB" if d.get("profile_peak_mib") else ""))
    if link:
        for kind, f in link["fit"].items():
            lines.append(f"link {kind}: {f['latency_s'] * 1e6:.0f} us per ring step, "
                         f"{f['bytes_per_s'] / 1e9:.2f} GB/s")
        for pair in link.get("pairs") or ():
            a, b = pair["ranks"]
            lines.append(f"send {a} -> {b}: {pair['latency_s'] * 1e6:.0f} us, {pair['bytes_per_s'] / 1e9:.3f} GB/s")
    lines.append(f"wrote {out}")
    return "\n".join(lines)
