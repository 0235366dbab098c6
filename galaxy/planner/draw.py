"""`plan.py search --png`: the chosen plan as a picture.

Left, ranks x sub-blocks (ATT, CON, MLP): each cell names the method and the rank's share
(heads, columns or tokens; "all" when replicated), shaded by the share's fraction of the whole;
the pipeline stage, replica and layers of each rank on its label. Right, the predicted time of a
step per rank: its own compute, the communication it takes part in, and idle time (waiting for
slower ranks, pipeline bubbles). matplotlib's object API on the Agg canvas (no display needed).
"""
from __future__ import annotations

import os

from galaxy.planner.cost import Estimate


def _cells(est: Estimate, model: dict, j: int):
    plan, g = est.plan, est.plan.group
    heads, _ = model["units"]["att_tp"]
    columns = model["units"]["mlp_tp"][0]
    seq = model["pad_size"]

    def share(method, tp_units, tp_total, what):
        if g == 1:
            return "whole", 1.0
        if method == "TP":
            return f"TP {tp_units} {what}", tp_units / tp_total
        return f"SP {plan.tokens[j]} tok", plan.tokens[j] / seq
    att = share(plan.att, plan.heads[j], heads, "heads")
    mlp = share(plan.mlp, plan.columns[j], columns, "cols")
    if g == 1 or plan.con != "SP":
        con = ("whole" if g == 1 else "None (whole)", 1.0)
    else:
        con = (f"SP {plan.tokens[j]} tok", plan.tokens[j] / seq)
    return [att, con, mlp]


def draw_plan(est: Estimate, model: dict, devices: list[dict], path: str) -> str:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    plan = est.plan
    world = len(est.memory_mib)
    fig = Figure(figsize=(12, 1.8 + 0.55 * world))
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    cmap = fig.colormaps["Blues"] if hasattr(fig, "colormaps") else None
    labels = []
    starts = [sum(plan.stages[:p]) for p in range(plan.pp)]
    for r in range(world):          # launch ranks; their mesh positions through plan.rank_order
        pos = plan.position_of(r)
        j, d, p = pos % plan.group, (pos // plan.group) % plan.dp, pos // (plan.group * plan.dp)
        first = starts[p]
        labels.append(f"rank {r}: {devices[r].get('name', '')[:18]}\nstage {p} (layers {first}-"
                      f"{first + plan.stages[p] - 1}), replica {d}")
        for c, (text, frac) in enumerate(_cells(est, model, j)):
            color = cmap(0.15 + 0.6 * frac) if cmap else (1 - 0.5 * frac, 1 - 0.3 * frac, 1)
            left.add_patch(_rect(fig, c, world - 1 - r, color))
            left.text(c + 0.5, world - 0.5 - r, text, ha="center", va="center", fontsize=8)
    left.set_xlim(0, 3)
    left.set_ylim(0, world)
    left.set_xticks([0.5, 1.5, 2.5], ["ATT", "CON", "MLP"])
    left.set_yticks([world - 0.5 - r for r in range(world)], labels, fontsize=7)
    ck = ", ".join(str(plan.recomputed_in_stage(p)) for p in range(plan.pp)) if plan.checkpoint else "none"
    left.set_title(f"pp {plan.pp} x dp {plan.dp} x group {plan.group}, {plan.microbatches} micro-batch(es)"
                   f"{' ' + plan.schedule if plan.pp > 1 else ''}"
                   f"{' warm-up ' + ','.join(map(str, plan.warmup)) if plan.warmup else ''}, recomputed layers per stage: {ck}", fontsize=9)

    ys = list(range(world))[::-1]
    busy, comm, idle = step_parts(est)
    right.barh(ys, busy, color="#4c72b0", label="own compute")
    right.barh(ys, comm, left=busy, color="#dd8452", label="communication (exposed)")
    right.barh(ys, idle, left=[b + c for b, c in zip(busy, comm)], color="#dddddd",
               label="idle: slower ranks, bubbles")
    for y, mem in zip(ys, est.memory_mib):
        right.text(est.step_s * 1.01, y, f"{mem:.0f} MiB", va="center", fontsize=7)
    right.set_yticks(ys, [f"rank {r}" for r in range(world)], fontsize=7)
    right.set_xlim(0, est.step_s * 1.25)
    right.set_xlabel("seconds per step (predicted)")
    right.set_title(f"predicted step {est.step_s * 1e3:.1f} ms", fontsize=9)
    right.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.28 if world < 4 else -0.12), ncol=3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def step_parts(est: Estimate) -> tuple[list[float], list[float], list[float]]:
    """Per rank, the predicted step split into its own compute, the communication it takes part
    in (the cost model overlaps none of it with compute, so all of it is exposed) and idle time
    (waiting for a slower rank at a collective, a pipeline's bubbles): the three sum to the step."""
    busy = [min(c, est.step_s) for c in est.compute_s]
    comm = [min(c, est.step_s - b) for c, b in zip(est.comm_rank_s or [0.0] * len(busy), busy)]
    idle = [est.step_s - b - c for b, c in zip(busy, comm)]
    return busy, comm, idle


def _rect(fig, x, y, color):
    from matplotlib.patches import Rectangle
    return Rectangle((x + 0.02, y + 0.05), 0.96, 0.9, facecolor=color, edgecolor="white")
