"""plan.py search --objective latency: the plan that generates one request soonest and fits.

The training search (galaxy.planner.search.Searcher) drives the latency cost model
(galaxy.planner.latency_cost) unchanged: the mesh (pp x Galaxy group; dp 1 only, since a replica
serves another request and cuts none of this one's time), the methods, heads / columns / tokens
proportional to speed then moved unit by unit, layers per stage. At batch 1 there is one
micro-batch and, without backward, nothing to recompute. The table and --json add the prefill,
the decode step and each rank's KV cache.
"""
from __future__ import annotations

from galaxy.planner.encoder_latency import EncoderLatencyCostModel
from galaxy.planner.latency_cost import LatencyCostModel
from galaxy.planner.search import SearchResult, Searcher, divisors
from galaxy.planner.table import describe, mib
from galaxy.planner.writer import plan_keys, prediction


DEFAULT_NEW_TOKENS = 64


def add_objective_arguments(p) -> None:
    """search's --objective and the request's size."""
    p.add_argument("--objective", choices=("step", "latency"), default="step",
                   help="step: the fastest training step (default); latency: the quickest generation of one "
                        "request at batch 1, forward only with a KV cache, dp 1 (written for generate.py)")
    p.add_argument("--prompt_tokens", type=int, metavar="N",
                   help="--objective latency: the prompt's tokens (default: the config's pad_size)")
    p.add_argument("--new_tokens", type=int, metavar="M",
                   help=f"--objective latency: the tokens generated (default {DEFAULT_NEW_TOKENS}; generate.py's "
                        "--max_new_tokens is a flag, not a config key)")
    p.add_argument("--all_devices", action="store_true",
                   help="--objective latency: plan over every device (default: also over each subset of them, "
                        "leaving out a device that every plan using it would slow)")


def is_encoder(model: dict) -> bool:
    """Whether the model profile is an encoder classifier's (one forward a request), not a causal LM's."""
    return model.get("task") == "classification" and not model.get("encoder_decoder")


def latency_cost_model(model: dict, devices: list[dict], link: dict | None, *, prompt: int, new: int,
                       choose_chunks: bool = False):
    """The latency cost model of the profile's model: an encoder classifier's one forward, else a
    causal LM's generation of `new` tokens after a `prompt`-token prompt (choose_chunks: the search's
    prefill_chunks, galaxy.planner.chunked_prefill)."""
    if is_encoder(model):
        return EncoderLatencyCostModel(model, devices, link)
    return LatencyCostModel(model, devices, link, prompt_tokens=prompt, new_tokens=new, choose_chunks=choose_chunks)


def search_latency(cost: LatencyCostModel, budgets: list[float], *, top: int = 5,
                   pps: list[int] | None = None) -> SearchResult:
    """The plans that fit, quickest request first (pps: the pipeline degrees to try; default all)."""
    meshes = [(pp, 1) for pp in (pps or divisors(cost.world))]
    return Searcher(cost, budgets, meshes=meshes).run(top)


def latency_table(ranked, prompt: int, new: int) -> str:
    if new == 0:
        return encoder_table(ranked, prompt)
    head = (f"{'#':>2} {'total ms':>9} {'prefill ms':>10} {'decode ms/tok':>13}  {'pp x dp x g':<12} "
            f"{'ATT MLP CON':<12} {'stages':<8} {'chunks':>6}  MiB per rank (KV cache) | shares per Galaxy rank")
    lines = [f"one request at batch 1: a {prompt}-token prompt, {new} new tokens (the prefill chooses the first, "
             f"{max(0, new - 1)} decode steps the rest); dp 1 only: replicas serve other requests, they do not "
             "shorten this one; chunks: the prompt's token chunks through a pipeline (prefill_chunks)", head]
    for i, est in enumerate(ranked, 1):
        d = describe(est.plan)
        mem = ",".join(f"{mib(m)} ({mib(c)})" for m, c in zip(est.memory_mib, est.cache_mib))
        lines.append(f"{i:>2} {est.step_s * 1e3:>9.2f} {est.prefill_s * 1e3:>10.2f} "
                     f"{est.decode_s_per_token * 1e3:>13.3f}  {d['mesh']:<12} {d['methods']:<12} {d['stages']:<8} "
                     f"{est.plan.prefill_chunks:>6}  {mem} | {d['splits']}")
    return "\n".join(lines)


def encoder_table(ranked, tokens: int) -> str:
    """An encoder classifier's plans: one forward each, no cache."""
    lines = [f"one request at batch 1: one forward of a {tokens}-token input (pad_size), the pooler and classifier "
             "on one rank; dp 1 only: replicas serve other requests, they do not shorten this one",
             f"{'#':>2} {'forward ms':>10}  {'pp x dp x g':<12} {'ATT MLP CON':<12} {'stages':<8} "
             "MiB per rank | shares per Galaxy rank"]
    for i, est in enumerate(ranked, 1):
        d = describe(est.plan)
        lines.append(f"{i:>2} {est.step_s * 1e3:>10.2f}  {d['mesh']:<12} {d['methods']:<12} {d['stages']:<8} "
                     f"{','.join(mib(m) for m in est.memory_mib)} | {d['splits']}")
    return "\n".join(lines)


def latency_prediction(est) -> dict:
    """A plan's --json fields: the training search's (predicted_step_s: the whole request), and the
    request's parts."""
    return {"prefill_s": round(est.prefill_s, 9), "decode_s_per_token": round(est.decode_s_per_token, 9),
            "kv_cache_mib": [round(c, 3) for c in est.cache_mib]}


def latency_document(result, layers: int, trainable: int, prompt: int, new: int) -> dict:
    """search --objective latency --json: the ranked plans (or, when none fits, the shortfall)."""
    request = {"objective": "latency", "task": "causal_lm" if new else "classification", "prompt_tokens": prompt,
               "new_tokens": new, "batch": 1}
    if result.ranked:
        return {**request, "plans": [{"keys": plan_keys(e, layers), **prediction(e, trainable),
                                      **latency_prediction(e)} for e in result.ranked]}
    lean = result.leanest
    return {**request, "shortfall_mib": None if lean is None else [round(x, 1) for x in lean.shortfall(result.budgets)],
            "memory_budget_mib": [round(b, 1) for b in result.budgets],
            "leanest": None if lean is None else {"keys": plan_keys(lean, layers), **prediction(lean, trainable),
                                                   **latency_prediction(lean)}}
