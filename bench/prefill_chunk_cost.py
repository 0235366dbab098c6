"""What a chunk of the prompt costs beyond its share of the whole prompt, on one device.

A pipeline's chunked prefill (prefill_chunks, galaxy.inference.chunked_prefill) runs each stage's
layers once per chunk. This bench takes the communication away (one process, the serial bench
Llama of inference_latency.py: 8 x 1024, fp32, batch 1) and times, interleaved, median of
--repeats after a warm-up:

  prefill    Engine.generate(max_new_tokens=1) of a --prompt-token prompt in C chunks (C = 1: the
             whole prompt), the real code path: ChunkedPrefill with no peer
  products   every layer's seven projections (q, k, v, o, gate, up, down) on [C chunks of c
             tokens] against their own weights, as the chunks run them (F.linear, layer by layer)
  attention  each chunk's queries over the keys cached so far, as cached_attention's prefill calls
             SDPA: under the causal + padding mask cut to the chunk's rows; and the whole prompt
             under the kernel's own causal flag (what training and the profile's harness run)
  rest       prefill - products - attention: the norms, SwiGLU, rotary, cache writes and Python
  oneDNN     the products again through oneDNN with each weight packed once (not what the model
             runs: what a pass would cost if it did)

and the latency planner's prediction of the whole prompt from a forward-only profile taken in the
same process (galaxy.planner.harness: ATT, MLP, two CONs a layer, the embedding). Prints, per C,
the milliseconds of each part and what each costs per chunk per layer beyond C = 1.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/prefill_chunk_cost.py [--chunks 1 2 4 8 16] [--prompt 512]
        [--repeats 3] [--json out.json]
    flock /work/testbed.lock timeout 600 .venv/bin/python -m galaxy.edge run --shield \\
        --cluster runs/bench/laptop.json -- .venv/bin/python bench/prefill_chunk_cost.py
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from galaxy.inference.chunked_prefill import chunk_spans  # noqa: E402
from galaxy.inference.requests import Request  # noqa: E402
from galaxy.planner.harness import SubBlockBench  # noqa: E402
from inference_latency import SHAPE, galaxy_engine, write_model  # noqa: E402

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def layer_weights(model) -> list[list[torch.Tensor]]:
    """Per layer, the seven projections' weights [out, in]."""
    out = []
    for layer in model.layers:
        mods = dict(layer.named_modules())
        out.append([m.weight for name, m in mods.items() if name.rpartition(".")[2] in PROJECTIONS])
    return out


def products(weights, spans, h: int, columns: int):
    """The projections of every chunk, in the order the chunks run them (layer by layer within a
    chunk: each chunk reads every layer's weights once)."""
    inputs = {c: (torch.randn(1, c, h), torch.randn(1, c, columns)) for c in {b - a for a, b in spans}}

    def run():
        for a, b in spans:
            x, wide = inputs[b - a]
            for layer in weights:
                for w in layer:
                    F.linear(wide if w.shape[1] == columns else x, w)
    return run


def products_onednn(weights, packed, spans, h: int, columns: int):
    """products() through oneDNN (torch._C._nn.mkldnn_linear) instead of F.linear's MKL sgemm, on
    `packed`: each weight converted to oneDNN's layout once for every pass (results within fp32
    round-off of F.linear's)."""
    inputs = {c: (torch.randn(1, c, h), torch.randn(1, c, columns)) for c in {b - a for a, b in spans}}

    def run():
        for a, b in spans:
            x, wide = inputs[b - a]
            for layer, dense in zip(packed, weights):
                for w, d in zip(layer, dense):
                    torch._C._nn.mkldnn_linear((wide if d.shape[1] == columns else x).to_mkldnn(), w, None).to_dense()
    return run


def attention(spans, heads: int, d: int, causal_flag: bool):
    """Each chunk's queries [1, heads, c, d] over the b keys cached so far under the cut causal
    mask [1, 1, c, b] (cached_attention's prefill), 8 layers' worth; causal_flag (one span only):
    the whole prompt under SDPA's is_causal, no mask."""
    S = spans[-1][1]
    q, k, v = (torch.randn(1, heads, S, d) for _ in range(3))
    mask = torch.ones(S, S, dtype=torch.bool).tril()[None, None]

    def run():
        for _ in range(SHAPE["num_hidden_layers"]):
            for a, b in spans:
                if causal_flag:
                    F.scaled_dot_product_attention(q, k, v, is_causal=True)
                else:
                    F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, :b], v[:, :, :b], attn_mask=mask[..., a:b, :b])
    return run


def harness_prediction(path: str, prompt: int, repeats: int) -> dict:
    """The latency planner's whole-prompt prefill from a forward-only harness profile (ms): each
    layer's ATT (its causal kernel), MLP and two CONs, the embedding."""
    bench = SubBlockBench(path, seq=prompt, num_labels=None, tie_head=True)
    bench.model.eval()
    parts = {}
    with torch.no_grad():
        for kind, units in (("att_tp", SHAPE["num_attention_heads"]), ("mlp_tp", SHAPE["intermediate_size"]),
                            ("con", prompt), ("embed", prompt)):
            run = bench.runner(kind, units, 1)
            run()
            parts[kind] = statistics.median(run()[0] for _ in range(repeats)) * 1e3
    layers = SHAPE["num_hidden_layers"]
    parts["predicted"] = layers * (parts["att_tp"] + parts["mlp_tp"] + 2 * parts["con"]) + parts["embed"]
    return parts


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model_path", default=str(ROOT / "runs/bench/prefill_chunk_cost/model"))
    p.add_argument("--json")
    # the testbed's rank arguments (one device: nothing to join)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--init_method")
    args = p.parse_args()
    if not Path(args.model_path, "config.json").exists():
        write_model(args.model_path)
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mkstemp()[1]}", world_size=1, rank=0)
    engine = galaxy_engine(args.model_path)
    ids = tuple(torch.randint(3, SHAPE["vocab_size"], (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist())
    h, cols, heads = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["num_attention_heads"]
    weights = layer_weights(engine.model)
    packed = [[w.detach().to_mkldnn() for w in layer] for layer in weights]
    runs, tokens = {}, {}
    for c in args.chunks:
        spans = chunk_spans(args.prompt, c)

        def prefill(c=c):
            engine.plan = replace(engine.plan, prefill_chunks=c)
            tokens[c] = tuple(engine.generate([Request("", ids, 1, ignore_eos=True)])[0].tokens)
        runs[c, "prefill"] = prefill
        runs[c, "products"] = products(weights, spans, h, cols)
        runs[c, "attention"] = attention(spans, heads, h // heads, False)
        runs[c, "oneDNN products"] = products_onednn(weights, packed, spans, h, cols)
    runs[1, "attention causal"] = attention(chunk_spans(args.prompt, 1), heads, h // heads, True)
    for fn in runs.values():
        fn()
    times = {key: [] for key in runs}
    for _ in range(args.repeats):
        for key, fn in runs.items():
            times[key].append(timed(fn))
    ms = {key: statistics.median(t) for key, t in times.items()}
    harness = harness_prediction(args.model_path, args.prompt, args.repeats)
    layers = SHAPE["num_hidden_layers"]
    lines = [f"threads {torch.get_num_threads()}, prompt {args.prompt}; medians of {args.repeats} (ms)",
             f"{'chunks':>6} {'prefill':>9} {'products':>9} {'attention':>9} {'rest':>8}   "
             f"beyond C=1, per chunk per layer: {'prefill':>8} {'products':>9} {'attention':>9} {'rest':>7}"]
    base = {part: ms[1, part] for part in ("prefill", "products", "attention")} if 1 in args.chunks else None
    table = {}
    for c in args.chunks:
        row = {part: ms[c, part] for part in ("prefill", "products", "attention")}
        row["rest"] = row["prefill"] - row["products"] - row["attention"]
        table[c] = row
        extra = ""
        if base and c > 1:
            per = {k: (row[k] - (base[k] if k != "rest" else base["prefill"] - base["products"] - base["attention"]))
                   / ((c - 1) * layers) for k in row}
            extra = " " * 34 + " ".join(f"{per[k]:{w}.2f}" for k, w in (("prefill", 8), ("products", 9),
                                                                         ("attention", 9), ("rest", 7)))
        lines.append(f"{c:>6} {row['prefill']:9.1f} {row['products']:9.1f} {row['attention']:9.1f} "
                     f"{row['rest']:8.1f} {extra}")
    lines.append("products through oneDNN, weights packed once (ms): " + ", ".join(
        f"{c} chunks {ms[c, 'oneDNN products']:.1f}" for c in args.chunks))
    lines.append(f"whole prompt's attention under SDPA's causal flag: {ms[1, 'attention causal']:.1f} ms "
                 f"(under the mask: {ms.get((1, 'attention'), float('nan')):.1f})")
    lines.append("harness (the planner's profile, forward only): " + ", ".join(f"{k} {v:.1f}" for k, v in harness.items()))
    lines.append("greedy tokens equal across chunk counts: " + ("yes" if len(set(tokens.values())) == 1 else "NO"))
    print("\n".join(lines), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"threads": torch.get_num_threads(), "prompt": args.prompt,
                                               "ms": {str(c): r for c, r in table.items()},
                                               "attention_causal_ms": ms[1, "attention causal"],
                                               "onednn_products_ms": {str(c): ms[c, "oneDNN products"] for c in args.chunks},
                                               "harness_ms": harness, "summary": lines}, indent=1))


if __name__ == "__main__":
    main()
