"""A PNG of a run's training loss and dev accuracy, drawn from its metrics file.

    python -m galaxy.train.plot runs/bert_galaxy/metrics.jsonl   # -> runs/bert_galaxy/metrics.png

Uses matplotlib's object API with the Agg canvas: no display, and no change to the process's
global pyplot backend. matplotlib is an optional dependency (the "demo" extra).
"""
from __future__ import annotations

import os
import sys

from galaxy.train.metrics import current_run, read_metrics


def plot_path_for(metrics_file: str) -> str:
    """runs/x/metrics.jsonl -> runs/x/metrics.png"""
    return os.path.splitext(metrics_file)[0] + ".png"


def _moving_average(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_metrics(metrics_file: str, out_path: str | None = None, chance: float | None = None) -> str:
    """Draw the latest run in `metrics_file`; returns the PNG's path. chance: 1 / num_classes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = current_run(read_metrics(metrics_file))
    steps = [r for r in records if "event" not in r and r.get("loss") is not None]
    evals = [r for r in records if r.get("event") == "eval"]
    tests = [r for r in records if r.get("event") == "test"]
    out_path = out_path or plot_path_for(metrics_file)

    fig = Figure(figsize=(9, 6.5), layout="constrained")
    FigureCanvasAgg(fig)
    loss_ax, acc_ax = fig.subplots(2, 1, sharex=True)
    xs, losses = [r["step"] for r in steps], [r["loss"] for r in steps]
    loss_ax.plot(xs, losses, color="tab:blue", alpha=0.3, linewidth=1, label="training loss (per step)")
    window = max(1, len(xs) // 20)
    if window > 1:
        loss_ax.plot(xs, _moving_average(losses, window), color="tab:blue", linewidth=2,
                     label=f"training loss ({window}-step mean)")
    if evals:
        loss_ax.plot([r["step"] for r in evals], [r["loss"] for r in evals], "o-", color="tab:orange",
                     label="dev loss")
    loss_ax.set_ylabel("cross-entropy")
    loss_ax.set_title(f"Training: {os.path.basename(os.path.dirname(os.path.abspath(metrics_file)))}")
    loss_ax.grid(alpha=0.3)
    loss_ax.legend(loc="upper right")

    if evals:
        acc_ax.plot([r["step"] for r in evals], [r["accuracy"] for r in evals], "o-", color="tab:green",
                    label="dev accuracy")
        for r in evals:
            acc_ax.annotate(f"{r['accuracy']:.3f}", (r["step"], r["accuracy"]), textcoords="offset points",
                            xytext=(-6, 8), ha="right", color="tab:green")
    for r in tests:   # hollow, so that the dev point of the same step stays visible
        acc_ax.plot([r["step"]], [r["accuracy"]], "s", markersize=10, markerfacecolor="none",
                    color="tab:purple", label=f"test accuracy {r['accuracy']:.3f}")
    if chance is not None:
        acc_ax.axhline(chance, color="gray", linestyle="--", linewidth=1, label=f"chance ({chance:.2f})")
    acc_ax.set_ylim(0, 1.05)
    acc_ax.set_xlabel("optimizer step")
    acc_ax.set_ylabel("accuracy")
    acc_ax.grid(alpha=0.3)
    if acc_ax.get_legend_handles_labels()[0]:
        acc_ax.legend(loc="lower right")
    fig.savefig(out_path, dpi=110)
    return out_path


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: python -m galaxy.train.plot METRICS_JSONL [OUT_PNG]")
    print(plot_metrics(*sys.argv[1:]))
