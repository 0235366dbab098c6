"""plan.py search --objective latency over subsets of the devices: a device on a slow link can make
every plan that uses it slower than the plans without it (home3's pi on 100 Mbit/s: a prompt's
activations cross its link at every layer), so the search also plans each subset of the devices
and keeps the quickest request; a device is left out only where every plan that uses it is
predicted slower. The written config runs on the chosen devices alone (generate.py --world k).

A subset's link is the profiled link seen from those devices (sub_link): its pairs renumbered,
and its fit moving bytes at the subset's own slowest pair rate where per-pair sends were measured
(through one switch a ring is as slow as its slowest member's link:
galaxy.planner.link_model.group_scale); the world's measured collectives stand only for the whole
world, the one-token calls (latency-bound) for every subset.
"""
from __future__ import annotations

from itertools import combinations

from galaxy.planner.latency_search import latency_cost_model, search_latency
from galaxy.planner.search import divisors

TOKEN_CALLS = ("token_sum", "broadcast")


def sub_link(link: dict | None, ranks: tuple[int, ...], world: int) -> dict | None:
    """The link among `ranks` (in that order) of a world of `world` devices (module docstring);
    None for one device."""
    if link is None or len(ranks) < 2:
        return None
    if len(ranks) == world:
        return link
    pairs = link.get("pairs") or []
    inside = [p for p in pairs if set(p["ranks"]) <= set(ranks)]
    scale = max(1.0, min(p["bytes_per_s"] for p in inside) / min(p["bytes_per_s"] for p in pairs)) if inside else 1.0
    index = {r: i for i, r in enumerate(ranks)}
    return {**link, "world": len(ranks),
            "fit": {k: {**f, "bytes_per_s": f["bytes_per_s"] * scale} for k, f in link["fit"].items()},
            "measured": [m for m in link.get("measured") or () if m.get("kind") in TOKEN_CALLS],
            "pairs": [{**p, "ranks": [index[a] for a in p["ranks"]]} for p in inside] or None}


def search_subsets(model: dict, devices: list[dict], link: dict | None, budgets: list[float], *, prompt: int,
                   new: int, top: int = 5, pps: list[int] | None = None, every_device: bool = False):
    """[(ranks, SearchResult)] for every subset of the devices (only all of them with every_device),
    the subset whose best plan is quickest first (among equals, the one with more devices); a
    subset no --pp fits is skipped."""
    n, out = len(devices), []
    sizes = [n] if every_device else range(n, 0, -1)
    for k in sizes:
        for ranks in combinations(range(n), k):
            allowed = [p for p in (pps or divisors(k)) if k % p == 0]
            if not allowed:
                continue
            cost = latency_cost_model(model, [devices[r] for r in ranks], sub_link(link, ranks, n), prompt=prompt,
                                      new=new, choose_chunks=True)
            out.append((ranks, search_latency(cost, [budgets[r] for r in ranks], top=top, pps=allowed), cost))
    quickest = lambda item: (not item[1].ranked, item[1].ranked[0].step_s if item[1].ranked else 0.0, -len(item[0]))  # noqa: E731
    return sorted(out, key=quickest)


def subset_lines(found, devices: list[dict]) -> list[str]:
    """One line per subset searched: its best plan's request, prefill and decode step."""
    lines = ["devices used   total ms  prefill ms  decode ms/tok  (each subset's quickest plan)"]
    for ranks, result, cost in found:
        names = ",".join(devices[r].get("name", str(r)).split(" rank ")[0] for r in ranks)
        if result.ranked:
            e = result.ranked[0]
            decode = f"{e.decode_s_per_token * 1e3:14.3f}" if cost.new else f"{'-':>14}"     # a classifier: none
            lines.append(f"{names:<14} {e.step_s * 1e3:9.1f} {e.prefill_s * 1e3:11.1f} {decode}")
        else:
            lines.append(f"{names:<14}  no plan fits")
    return lines


def subset_summary(found) -> list[dict]:
    """--json's "subsets": each subset's ranks and its quickest plan's figures (null: none fits)."""
    return [{"ranks": list(ranks), "total_s": round(r.ranked[0].step_s, 9) if r.ranked else None,
             "prefill_s": round(r.ranked[0].prefill_s, 9) if r.ranked else None,
             "decode_s_per_token": round(r.ranked[0].decode_s_per_token, 9) if r.ranked else None}
            for ranks, r, _ in found]
