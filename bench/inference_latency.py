"""Serial inference latency, galaxy's KV-cached engine against Hugging Face, side by side.

A random Llama (8 layers, hidden 1024, 16 heads, MLP 2816, vocab 32000; issue 31's bench model)
written once to a scratch folder, loaded by both from the same safetensors, batch 1, fp32, same
process and torch threads:

  prefill   a --prompt-token prompt to its first new token: galaxy's Engine.generate with
            max_new_tokens 1 against HF generate(max_new_tokens=1) (both run the prompt once with
            their cache and the LM head on the last position only), and against a bare HF
            forward(use_cache=True, logits_to_keep=1)
  decode    tokens/s of the steps after the first: (K - 1) / (t(K) - t(1)) where t(K) is the
            median time to generate K tokens (--new) after a --decode_prompt-token prompt, the
            end-of-sequence token ignored; HF generate with its cache (do_sample=False)

Runs alternate galaxy, HF, HF, galaxy, ... after one warm-up each, so machine noise hits both. The
greedy tokens of both are compared (they must be equal). Prints medians, the galaxy / HF ratios
and PASS / FAIL against the targets (decode >= 0.9x HF's tokens/s; prefill within 5% of HF).

    HF_HUB_OFFLINE=1 .venv/bin/python bench/inference_latency.py [--threads 2] [--repeats 5]
        [--prompt 512] [--decode_prompt 32] [--new 64] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from galaxy.assets.tiny_llama import default_tokenizer  # noqa: E402
from galaxy.distributed.mesh import make_mesh  # noqa: E402
from galaxy.inference.engine import Engine  # noqa: E402
from galaxy.inference.requests import Request  # noqa: E402
from galaxy.plan import Plan  # noqa: E402
from galaxy.runtime.assemble import build_model  # noqa: E402

SHAPE = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16,
             intermediate_size=2816, vocab_size=32000, max_position_embeddings=2048, pad_token_id=0,
             bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
DECODE_TARGET, PREFILL_TARGET = 0.9, 1.05


def write_model(path: str, shape: dict = SHAPE):
    """The random bench Llama (seed 0; SHAPE unless a smaller one is given) and a tokenizer for the
    engine (ids are drawn, not encoded)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**shape)).save_pretrained(path)
    default_tokenizer().save_pretrained(path)
    hf = LlamaForCausalLM.from_pretrained(path).eval()
    hf.generation_config.eos_token_id = None          # exactly max_new_tokens, as galaxy's ignore_eos
    return hf


def galaxy_engine(path: str) -> Engine:
    heads, columns = SHAPE["num_attention_heads"], SHAPE["intermediate_size"]
    plan = Plan("TP", "TP", "None", heads=(heads,), columns=(columns,), tokens=(SHAPE["max_position_embeddings"],))
    mesh = make_mesh(plan)
    model = build_model(path, plan, mesh.galaxy)
    from transformers import AutoTokenizer
    return Engine(model, plan, mesh, AutoTokenizer.from_pretrained(path), eos_ids=[SHAPE["eos_token_id"]])


def run_galaxy(engine: Engine, ids: list[int], new: int):
    start = time.perf_counter()
    done = engine.generate([Request("", tuple(ids), new, ignore_eos=True)])
    return time.perf_counter() - start, done[0].tokens


@torch.no_grad()
def run_hf(model, ids: list[int], new: int):
    x = torch.tensor([ids])
    start = time.perf_counter()
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False, pad_token_id=0)
    return time.perf_counter() - start, out[0, len(ids):].tolist()


@torch.no_grad()
def run_hf_forward(model, ids: list[int], _new: int):
    x = torch.tensor([ids])
    start = time.perf_counter()
    model(x, use_cache=True, logits_to_keep=1)
    return time.perf_counter() - start, None


def paired(runs: dict, ids: list[int], new: int, repeats: int) -> dict:
    """{name: (median seconds, tokens)} of each runner, alternating their order every round."""
    times = {name: [] for name in runs}
    tokens = {}
    names = list(runs)
    for name in names:                                   # warm-up
        runs[name](ids, new)
    for i in range(repeats):
        for name in (names if i % 2 == 0 else names[::-1]):
            seconds, tokens[name] = runs[name](ids, new)
            times[name].append(seconds)
    return {name: (statistics.median(times[name]), tokens[name]) for name in names}


def measure(engine, hf, args) -> dict:
    draw = torch.Generator().manual_seed(1)
    long_ids = [1] + torch.randint(3, SHAPE["vocab_size"], (args.prompt - 1,), generator=draw).tolist()
    short_ids = long_ids[:args.decode_prompt]
    runs = {"galaxy": lambda i, n: run_galaxy(engine, i, n), "hf": lambda i, n: run_hf(hf, i, n)}
    prefill = paired({**runs, "hf_forward": lambda i, n: run_hf_forward(hf, i, n)}, long_ids, 1, args.repeats)
    one = paired(runs, short_ids, 1, args.repeats)
    many = paired(runs, short_ids, args.new, args.repeats)
    rate = {k: (args.new - 1) / max(many[k][0] - one[k][0], 1e-9) for k in runs}
    return {"prefill_ms": {k: v[0] * 1e3 for k, v in prefill.items()},
            "decode_tokens_per_s": rate,
            "tokens_equal": many["galaxy"][1] == many["hf"][1] and prefill["galaxy"][1] == prefill["hf"][1]}


def report(result: dict, args) -> None:
    p, d = result["prefill_ms"], result["decode_tokens_per_s"]
    prefill_ratio, forward_ratio = p["galaxy"] / p["hf"], p["galaxy"] / p["hf_forward"]
    decode_ratio = d["galaxy"] / d["hf"]
    load = os.getloadavg()
    print(f"random Llama 8 x 1024, 16 heads, batch 1, fp32, {args.threads} threads; load average "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"prefill {args.prompt} tokens (ms)   galaxy {p['galaxy']:8.1f}   HF generate {p['hf']:8.1f}   "
          f"HF forward {p['hf_forward']:8.1f}   galaxy/HF {prefill_ratio:.3f}   galaxy/HF forward {forward_ratio:.3f}   "
          f"{'PASS' if prefill_ratio <= PREFILL_TARGET else 'FAIL'} (<= {PREFILL_TARGET})")
    print(f"decode after {args.decode_prompt} (tokens/s)   galaxy {d['galaxy']:8.1f}   HF generate {d['hf']:8.1f}   "
          f"galaxy/HF {decode_ratio:.3f}   {'PASS' if decode_ratio >= DECODE_TARGET else 'FAIL'} (>= {DECODE_TARGET})")
    print(f"greedy tokens equal: {'yes' if result['tokens_equal'] else 'NO'}")
    result.update(prefill_ratio=prefill_ratio, prefill_vs_forward_ratio=forward_ratio, decode_ratio=decode_ratio,
                  load_average=load, threads=args.threads)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prompt", type=int, default=512, help="prefill prompt tokens")
    p.add_argument("--decode_prompt", type=int, default=32, help="prompt tokens before decoding")
    p.add_argument("--new", type=int, default=64, help="tokens generated for the decode rate")
    p.add_argument("--json")
    args = p.parse_args()
    if not 1 <= args.decode_prompt <= args.prompt <= SHAPE["max_position_embeddings"] - args.new or args.new < 2:
        p.error("need 1 <= --decode_prompt <= --prompt <= 2048 - --new and --new >= 2")
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mkstemp()[1]}", world_size=1, rank=0)
    with tempfile.TemporaryDirectory() as path:
        hf = write_model(path)
        engine = galaxy_engine(path)
        report(measure(engine, hf, args), args)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
