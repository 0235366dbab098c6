"""The bound of a TP decode step on the ranks this process is one of: its products alone, with no
communication, each rank at the same time as the others (issue 31 item 4).

Decode at batch 1 reads every weight once a token, so it is bound by memory bandwidth; on the edge
testbed the devices are CPU shares of one host and share its memory bus. Part 1 times one token's
products of inference_latency.py's Llama shape (8 layers x 1024, MLP 2816, vocab 32000, fp32,
batch 1), as plain F.linear calls on random weights of the shapes a rank holds, and attention over
a --context-token cache:

  whole alone       rank 0 runs every product of the whole model; the others wait in a barrier
  shard together    every rank runs its TP shard (1/world of the heads, MLP columns and LM-head
                    rows) at the same time: no collective between the tokens
  shard alone       rank 0 runs its shard; the others wait
  whole together    every rank runs the whole model at the same time (what sharing the bus costs)
  fused together    as "shard together" with Q/K/V one product and gate/up one product

ms a token, median over --repeats rounds (phases alternate) of --tokens tokens. The bound: the
tokens/s ratio no plan can beat on these devices, whole alone / the slowest rank's shard together.

Part 2 (--profile, world > 1): torch.profiler over Galaxy's tp engine on every rank, one decode
token = (run of 1 + --new tokens - run of 1) / --new: its self time split into products, other
operators, collectives (the calls that start them, and the waits: waiting.wait and the sampler's
blocking broadcast, each wrapped in a named range), and the wall time outside any operator (Python).

    python -m galaxy.edge run --cluster clusters/two_equal_1g.json -- \\
        .venv/bin/python bench/decode_bound.py [--profile] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from inference_latency import SHAPE  # noqa: E402
from galaxy.parallel.decode_layout import TOKEN_SUM_NAMES, default_token_sum  # noqa: E402
from testbed_args import add_rank_arguments, start_ranks  # noqa: E402

PRODUCTS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_dot_product", "aten::baddbmm", "aten::mv")
COLLECTIVE = ("gloo:", "c10d::", "record_param_comms", "nccl:")
WAIT_RANGE = "bench::wait"


def layer_weights(parts: int, fused: bool, g: torch.Generator) -> dict:
    """One layer's weights as one rank of `parts` holds them ([out, in], F.linear's)."""
    h, i = SHAPE["hidden_size"], SHAPE["intermediate_size"]
    qkv, cols = h // parts, i // parts

    def w(out, inp):
        return torch.randn(out, inp, generator=g) * 0.02
    att = {"qkv": w(3 * qkv, h)} if fused else {"q": w(qkv, h), "k": w(qkv, h), "v": w(qkv, h)}
    mlp = {"gate_up": w(2 * cols, h)} if fused else {"gate": w(cols, h), "up": w(cols, h)}
    return {**att, "o": w(h, qkv), **mlp, "down": w(h, cols)}


class Products:
    """One token's products of a rank's share (1/parts) of the bench Llama, attention over a cache."""

    def __init__(self, parts: int, context: int, fused: bool = False):
        g = torch.Generator().manual_seed(parts)
        self.fused, self.heads = fused, SHAPE["num_attention_heads"] // parts
        self.layers = [layer_weights(parts, fused, g) for _ in range(SHAPE["num_hidden_layers"])]
        d = SHAPE["hidden_size"] // SHAPE["num_attention_heads"]
        self.cache = torch.randn(2, 1, self.heads, context, d, generator=g)           # K, V [b, n, t, d]
        self.head = torch.randn(SHAPE["vocab_size"] // parts, SHAPE["hidden_size"], generator=g) * 0.02

    def token(self, x: torch.Tensor) -> torch.Tensor:
        """x [1, 1, h] through every layer's products (no norms, no residual: the products' bytes)."""
        for w in self.layers:
            if self.fused:
                q, k, v = F.linear(x, w["qkv"]).chunk(3, dim=-1)
            else:
                q, k, v = F.linear(x, w["q"]), F.linear(x, w["k"]), F.linear(x, w["v"])
            q = q.view(1, 1, self.heads, -1).transpose(1, 2)                            # [1, n, 1, d]
            ctx = F.scaled_dot_product_attention(q, self.cache[0], self.cache[1])
            out = F.linear(ctx.transpose(1, 2).reshape(1, 1, -1), w["o"])
            if self.fused:
                gate, up = F.linear(out, w["gate_up"]).chunk(2, dim=-1)
            else:
                gate, up = F.linear(out, w["gate"]), F.linear(out, w["up"])
            x = F.linear(F.silu(gate) * up, w["down"])
        return F.linear(x, self.head)


def timed_tokens(products: Products | None, tokens: int) -> float | None:
    """ms a token of `tokens` tokens after a barrier (None: this rank waits in the barriers)."""
    dist.barrier()
    ms = None
    if products is not None:
        x = torch.randn(1, 1, SHAPE["hidden_size"])
        start = time.perf_counter()
        for _ in range(tokens):
            products.token(x)
        ms = (time.perf_counter() - start) * 1e3 / tokens
    dist.barrier()
    return ms


@torch.no_grad()
def measure_bound(args) -> dict:
    """Every phase's ms a token on this rank (None where it waited), medians of --repeats."""
    world, rank = dist.get_world_size(), dist.get_rank()
    whole, shard = Products(1, args.context), Products(world, args.context)
    fused = Products(world, args.context, fused=True)
    phases = {"whole alone": whole if rank == 0 else None, "shard together": shard,
              "shard alone": shard if rank == 0 else None, "whole together": whole, "fused together": fused}
    for p in phases.values():                                               # warm-up
        timed_tokens(p, 2)
    times = {name: [] for name in phases}
    for i in range(args.repeats):
        for name in (list(phases) if i % 2 == 0 else list(phases)[::-1]):
            times[name].append(timed_tokens(phases[name], args.tokens))
    return {n: (statistics.median(t) if t[0] is not None else None) for n, t in times.items()}


def print_bound(per_rank: list[dict]) -> dict:
    print("products alone, ms a token (rank 0 / rank 1 ...):")
    for name in per_rank[0]:
        print(f"  {name:<16} " + "  ".join("   -   " if r[name] is None else f"{r[name]:7.2f}" for r in per_rank))
    slowest = {n: max(r[n] for r in per_rank if r[n] is not None) for n in per_rank[0]}
    bound = slowest["whole alone"] / slowest["shard together"]
    print(f"bound: tokens/s of the shards together / the whole alone = {bound:.3f}"
          f" (shard alone would give {slowest['whole alone'] / slowest['shard alone']:.3f}; fused products"
          f" {slowest['whole alone'] / slowest['fused together']:.3f}; whole together is"
          f" {slowest['whole together'] / slowest['whole alone']:.3f}x the whole alone's time)")
    return {"slowest_ms": slowest, "bound": bound}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--context", type=int, default=48, help="cached tokens attended (the bench's 32-prompt decode)")
    p.add_argument("--profile", action="store_true", help="also profile Galaxy's tp decode step on every rank")
    p.add_argument("--new", type=int, default=16)
    p.add_argument("--token_sum", default=default_token_sum("cpu"), choices=TOKEN_SUM_NAMES)
    p.add_argument("--comm_wait", default="auto", choices=("auto", "poll", "block"))
    p.add_argument("--json")
    add_rank_arguments(p)
    args = p.parse_args()
    torch.set_num_threads(1)
    start_ranks(args)
    per_rank = [None] * args.world
    dist.all_gather_object(per_rank, measure_bound(args))
    out = {"args": vars(args), "phases": per_rank}
    if args.rank == 0:
        out.update(print_bound(per_rank))
    if args.profile and args.world > 1:
        from decode_profile import profile_tp_decode
        out["profile"] = profile_tp_decode(args)
    if args.rank == 0 and args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
