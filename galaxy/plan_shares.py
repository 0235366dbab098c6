"""A plan's share lists: the Galaxy ranks' (heads, columns, tokens) as given, and the rows of
every global batch per data-parallel replica (the plan's `replica_rows`, config key dp_batch_list):
even (None) or uneven shares, in dp-rank order, summing to batch_size.

Replica d reads rows [sum(shares[:d]), sum(shares[:d + 1])) of each global batch, in its own
micro-batches of shares[d] / microbatches rows (equal within a replica: a pipeline's buffers are
static, and gradient accumulation splits the same way). Uneven shares let a slow device's replica
take fewer rows, so that every replica finishes its step at about the same time.
"""
from __future__ import annotations

KEY = "dp_batch_list"


def even_split(total: int, parts: int, unit: int = 1) -> list[int]:
    """Split total into parts multiples of unit that differ by at most one unit, larger first.

    even_split(12, 5) == [3, 3, 2, 2, 2]; even_split(8, 2, unit=2) == [4, 4].
    Raises ValueError when some part would be 0 or total is not a multiple of unit.
    """
    if parts < 1 or unit < 1:
        raise ValueError(f"parts and unit must be at least 1, got parts={parts} unit={unit}")
    if total % unit:
        raise ValueError(f"{total} is not a multiple of {unit}")
    units = total // unit
    if units < parts:
        raise ValueError(f"{units} units of {unit} cannot fill {parts} parts")
    base, extra = divmod(units, parts)
    return [(base + (i < extra)) * unit for i in range(parts)]



def proportional_split(total: int, weights) -> tuple[int, ...]:
    """Split total in proportion to weights, each part's end rounded (as the split LM head's
    vocabulary rows are); ValueError when a part would be 0. proportional_split(10, (3, 1)) == (8, 2)."""
    bounds = [round(total * sum(weights[:i]) / sum(weights)) for i in range(len(weights) + 1)]
    parts = tuple(b - a for a, b in zip(bounds, bounds[1:]))
    if min(parts) < 1:
        raise ValueError(f"{total} cannot be split in proportion to {tuple(weights)} with every part at least 1")
    return parts


def tokenwise_default(total: int, tokens, parts: int) -> tuple[int, ...]:
    """decode_intermediate_size_list left out: an SP MLP's decode columns in proportion to the token
    shares (under SP the only per-rank speed a config gives; even tokens, even columns), else even."""
    try:
        return proportional_split(total, tokens)
    except (TypeError, ValueError):          # no token shares, or a rank would get no column
        return tuple(even_split(total, parts))


def rows_per_replica(shares, batch_rows: int, dp: int) -> list[int]:
    """Every replica's rows of a global batch of batch_rows: the shares, or an even split."""
    if shares is not None:
        return list(shares)
    return [batch_rows // dp] * dp


def replica_slice(shares, index: int, batch_rows: int, dp: int) -> slice:
    """Replica index's rows within a global batch: [start, stop)."""
    rows = rows_per_replica(shares, batch_rows, dp)
    start = sum(rows[:index])
    return slice(start, start + rows[index])


def share_problems(shares, dp: int, batch_rows: int | None) -> list[str]:
    """What is wrong with a dp_batch_list for dp replicas and a global batch of batch_rows (None:
    not checked), one line each naming the key and the fix."""
    if shares is None:
        return []
    if dp == 1:
        return [f"{KEY} is set but dp_deg is 1: it splits each batch between data-parallel replicas; "
                f"set dp_deg to its length or remove {KEY}"]
    if len(shares) != dp:
        return [f"{KEY} has {len(shares)} entries but dp_deg is {dp}; give one row count per replica"]
    if batch_rows is not None and sum(shares) != batch_rows:
        return [f"{KEY} sums to {sum(shares)} but batch_size is {batch_rows}; make the entries add up to "
                f"{batch_rows}"]
    return []


def microbatch_problems(shares, dp: int, batch_rows: int | None, microbatches: int, pipelined: bool) -> list[str]:
    """Every replica's rows must split into `microbatches` equal micro-batches (one line: the first
    replica whose rows do not)."""
    if shares is None or batch_rows is None or len(shares) != dp:
        return []
    key = "num_microbatches" if pipelined else "grad_accum_steps"
    return [f"{KEY}[{d}] is {rows}, which does not split into {key} {microbatches} equal micro-batches; "
            f"give every replica a multiple of {microbatches} rows or lower {key}"
            for d, rows in enumerate(shares) if rows % microbatches][:1]


def given_share_problems(key, given, size, total, what, cells, kv_group, work) -> list[str]:
    """What is wrong with a given Galaxy share list (heads, columns or tokens): one line."""
    if len(given) != size:
        return [f"{key} has {len(given)} entries but the Galaxy group has {size} ranks ({cells})"]
    if sum(given) != total:
        return [f"{key} sums to {sum(given)} but {what} is {total}; make the entries add up to {total}"]
    for i, v in enumerate(given):
        if v % kv_group:
            return [f"{key}[{i}] is {v}, not a multiple of {kv_group}: the model's {work.heads} query "
                    f"heads share {work.kv_heads} KV heads, so each TP rank needs whole groups of "
                    f"{kv_group} heads"]
    return []
