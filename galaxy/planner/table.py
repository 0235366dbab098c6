"""The search's ranked plans as a table, and the one line that says why nothing fits."""
from __future__ import annotations


def describe(plan) -> dict:
    """The columns of the table for one plan."""
    g = plan.group
    splits = []
    if g > 1 and plan.att == "TP":
        splits.append("heads " + ",".join(map(str, plan.heads)))
    if g > 1 and plan.mlp == "TP":
        splits.append("cols " + ",".join(map(str, plan.columns)))
    if g > 1 and "SP" in (plan.att, plan.mlp, plan.con):
        splits.append("tok " + ",".join(map(str, plan.tokens)))
    if g > 1 and plan.mlp == "SP" and plan.decode_columns:
        splits.append("decode cols " + ",".join(map(str, plan.decode_columns)))     # generation's SP MLP
    if g > 1 and plan.decoder_tokens and "SP" in (plan.att, plan.mlp, plan.con, plan.xatt):
        splits.append("dec tok " + ",".join(map(str, plan.decoder_tokens)))     # an encoder-decoder's target
    if plan.dp > 1 and plan.replica_rows is not None:
        splits.append("rows " + ",".join(map(str, plan.replica_rows)))      # per DP replica (dp_batch_list)
    methods = f"{plan.att} {plan.mlp} {plan.con}" if g > 1 else "-"
    if g > 1 and plan.xatt:
        methods += f" X{plan.xatt}"      # an encoder-decoder's XATT
    mb = f"{plan.microbatches}" + (f" {plan.schedule}" if plan.pp > 1 else "")
    if plan.warmup is not None:         # 1f1b's warm-up forwards per stage (pipeline_warmup_list)
        mb += " w" + ",".join(map(str, plan.warmup))
    ck = "none" if not plan.checkpoint else ",".join(str(plan.recomputed_in_stage(p)) for p in range(plan.pp))
    extra = f" {plan.dp_sharding}" if plan.dp_sharding != "none" else ""
    stages = ",".join(map(str, plan.stages))
    if plan.rank_order is not None:     # the launch ranks in mesh order (mesh_rank_order)
        stages += " @" + ",".join(map(str, plan.rank_order))
    return {"mesh": f"{plan.pp}x{plan.dp}x{g}{extra}", "methods": methods, "splits": " ".join(splits) or "-",
            "stages": stages, "mb": mb, "ckpt": ck,
            "overlap": f"{plan.batch_streams} {plan.comm_chunks}"}     # batch_streams, comm_chunks


def table(ranked) -> str:
    head = (f"{'#':>2} {'step ms':>9}  {'pp x dp x g':<12} {'ATT MLP CON':<12} {'stages @ranks':<8} {'micro':<9} "
            f"{'recompute':<9} {'str chk':<7} {'MB sent/step':>12}  MiB per rank | shares per Galaxy rank (rows per replica)")
    lines = [head]
    for i, est in enumerate(ranked, 1):
        d = describe(est.plan)
        mem = ",".join(mib(m) for m in est.memory_mib)
        lines.append(f"{i:>2} {est.step_s * 1e3:>9.1f}  {d['mesh']:<12} {d['methods']:<12} {d['stages']:<8} "
                     f"{d['mb']:<9} {d['ckpt']:<9} {d['overlap']:<7} {max(est.sent_bytes) / 1e6:>12.2f}  {mem} | {d['splits']}")
    return "\n".join(lines)


def mib(x: float) -> str:
    return f"{x:.0f}" if abs(x) >= 10 else f"{x:.2g}"


def no_fit_line(result, devices, headroom: float = 0.0) -> str:
    """headroom: the percent of every budget kept free (the budgets in result are what is left)."""
    lean = result.leanest
    if lean is None:
        return "no plan can be formed for this world and batch (check batch_size, the devices and --pp / --dp)"
    short = lean.shortfall(result.budgets)
    worst = [r for r in range(len(short)) if short[r] > 0]
    kept = f" after {headroom:g}% headroom" if headroom else ""
    parts = [f"rank {r} ({devices[r].get('name', 'device')}) needs {mib(lean.memory_mib[r])} MiB, its budget is "
             f"{mib(result.budgets[r])} MiB{kept}: short by {mib(short[r])} MiB" for r in worst[:4]]
    more = f" and {len(worst) - 4} more ranks" if len(worst) > 4 else ""
    d = describe(lean.plan)
    methods = f"ATT MLP CON {d['methods']}, " if lean.plan.group > 1 else ""
    return (f"no plan fits the memory budgets; under the leanest plan (pp x dp x g {d['mesh']}, {methods}"
            f"{d['mb']} micro-batches, recomputed layers per stage {d['ckpt']}) " + "; ".join(parts) + more +
            "; raise --memory_mib, lower batch_size or pad_size, or add devices")
