"""Text tables of a ProfileReport: fixed-width columns, human units."""
from __future__ import annotations

from galaxy.profiler.report import ProfileReport


def human(n: float, unit: str = "", base: int = 1000) -> str:
    """1234567 -> '1.23 M' (+unit); bytes use base 1024 ('1.18 Mi')."""
    prefixes = ["", "K", "M", "G", "T", "P"]
    i, x = 0, float(n)
    while abs(x) >= base and i < len(prefixes) - 1:
        x /= base
        i += 1
    p = prefixes[i] + ("i" if base == 1024 and i else "")
    return f"{x:.0f} {p}{unit}".rstrip() if i == 0 else f"{x:.2f} {p}{unit}"


def human_check(measured: int, expected: int) -> str:
    """'exact' or the relative difference from the closed form, for printing."""
    if measured == expected:
        return "exact"
    return f"{(measured - expected) / max(expected, 1):+.2%}" if expected else "n/a"


def seconds(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"


def _row(cells, widths, left: int = 1) -> str:
    """Fixed-width cells: the first `left` aligned left, the rest right."""
    return "".join(f"{c:<{w}}" if i < left else f"{c:>{w}}" for i, (c, w) in enumerate(zip(cells, widths)))


def module_table(report: ProfileReport, depth: int = 3) -> str:
    """The module tree down to `depth` (0: the model only)."""
    heads = ["module", "params", "fwd FLOPs", "MACs", "bwd FLOPs", "fwd time", "bwd time", "FLOPs %", "time %"]
    t = report.totals
    flops_all = max(t.fwd_flops + t.bwd_flops, 1)
    time_all = max(t.fwd_latency_s + t.bwd_latency_s, 1e-12)
    rows = []
    for m in report.modules:
        if m.depth > depth:
            continue
        label = "  " * m.depth + (m.name.rpartition(".")[2] if m.name else report.model)
        if m.name and m.depth:
            label += f" ({m.type})"
        if not m.called and m.params and not m.fwd_flops:
            label += " *"
        rows.append([label, human(m.params), human(m.fwd_flops), human(m.macs), human(m.bwd_flops),
                     seconds(m.fwd_latency_s), seconds(m.bwd_latency_s),
                     f"{100 * (m.fwd_flops + m.bwd_flops) / flops_all:.1f}",
                     f"{100 * (m.fwd_latency_s + m.bwd_latency_s) / time_all:.1f}"])
    widths = [max(len(heads[0]), *(len(r[0]) for r in rows)) + 2] + [11, 12, 12, 12, 11, 11, 9, 8]
    lines = [_row(heads, widths), "-" * sum(widths)] + [_row(r, widths) for r in rows]
    lines.append("-" * sum(widths))
    lines.append(f"element-wise (norms, activations, softmax, residual adds, dropout; not in the FLOPs "
                 f"columns): fwd {human(t.elementwise_flops, 'FLOPs')}, bwd {human(t.bwd_elementwise_flops, 'FLOPs')}")
    if any(not m.called and m.params and not m.fwd_flops for m in report.modules if m.depth <= depth):
        lines.append("* weights applied by the parent module (it calls F.linear with them): "
                     "their FLOPs and time are the parent's")
    return "\n".join(lines)


def sub_block_table(report: ProfileReport) -> str:
    heads = ["layer", "sub-block", "params", "fwd FLOPs", "bwd FLOPs", "elem FLOPs", "act bytes",
             "fwd time", "bwd time"]
    widths = [7, 12, 9, 12, 12, 12, 12, 11, 11]
    lines = [_row(heads, widths, 2), "-" * sum(widths)]
    for s in report.sub_blocks:
        lines.append(_row([str(s.layer), f"{s.kind} ({s.name})", human(s.params), human(s.fwd_flops),
                           human(s.bwd_flops), human(s.fwd_elementwise_flops + s.bwd_elementwise_flops),
                           human(s.act_bytes, "B", 1024), seconds(s.fwd_latency_s), seconds(s.bwd_latency_s)],
                          widths, 2))
    return "\n".join(lines)


def summary(report: ProfileReport) -> str:
    t = report.totals
    plan = report.plan
    where = f"rank {report.rank} of {report.world}" + (
        f", plan ATT {plan['att']} / CON {plan['con']} / MLP {plan['mlp']}"
        + (f" / XATT {plan['xatt']}" if "xatt" in plan else "") if plan else "")
    lines = [f"{report.model}: batch {report.batch_size} x {report.seq_len} tokens, {where}",
             f"  params {human(t.params)}  fwd {human(t.fwd_flops, 'FLOPs')} ({human(t.macs, 'MACs')})  "
             f"bwd {human(t.bwd_flops, 'FLOPs')}  element-wise fwd {human(t.elementwise_flops, 'FLOPs')} "
             f"bwd {human(t.bwd_elementwise_flops, 'FLOPs')}",
             f"  saved activations {human(t.act_bytes, 'B', 1024)}  fwd {seconds(t.fwd_latency_s)}  "
             f"bwd {seconds(t.bwd_latency_s)}"]
    m = report.memory
    if m:
        sharded = f", sharded over {m['dp_shards']} replicas" if m["dp_shards"] > 1 else ""
        lines.append(f"  memory per rank: weights {human(m['weights'], 'B', 1024)}, gradients "
                     f"{human(m['grads'], 'B', 1024)}, optimizer state {human(m['optimizer'], 'B', 1024)}"
                     f"{sharded}; activations saved for backward {human(m['activations'], 'B', 1024)}; total "
                     f"{human(m['weights'] + m['grads'] + m['optimizer'] + m['activations'], 'B', 1024)}")
    lines += [f"  note: {n}" for n in report.notes]
    return "\n".join(lines)


def comm_table(reports: list[ProfileReport], expected: dict | None = None) -> str:
    """Bytes per training step, one row per rank and collective kind (ring convention)."""
    heads = ["rank", "collective", "calls", "sent", "received", "local fwd FLOPs", "local bwd FLOPs"]
    widths = [6, 16, 7, 12, 12, 17, 17]
    lines = [_row(heads, widths, 2), "-" * sum(widths)]
    for r in reports:
        kinds = r.comm["by_kind"] or {"(none)": {"calls": 0, "sent": 0, "received": 0}}
        for i, (kind, c) in enumerate(kinds.items()):
            lines.append(_row([str(r.rank) if i == 0 else "", kind, str(c["calls"]), human(c["sent"], "B", 1024),
                               human(c["received"], "B", 1024),
                               human(r.totals.fwd_flops) if i == 0 else "", human(r.totals.bwd_flops) if i == 0 else ""],
                              widths, 2))
    if expected is not None:
        ok = all(r.comm["by_kind"] == expected for r in reports)
        lines.append("closed form of the plan's transitions: "
                     + ", ".join(f"{k} {c['calls']} calls {human(c['sent'], 'B', 1024)}" for k, c in expected.items())
                     + (" -- matches every rank" if ok else " -- DIFFERS from the measured bytes"))
    lines.append("bytes per rank on the wire in a ring algorithm: all-gather and reduce-scatter (N-1) x padded "
                 "shard, all-reduce 2(N-1) x ceil(elements/N)")
    return "\n".join(lines)
