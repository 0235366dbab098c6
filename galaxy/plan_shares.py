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
# A Galaxy share list's plan field -> its config key.
SHARE_KEYS = {"heads": "tp_num_attention_heads_list", "columns": "tp_intermediate_size_list",
              "tokens": "seq_scatter_list", "decoder_tokens": "decoder_seq_scatter_list",
              "decode_columns": "decode_intermediate_size_list"}


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


def galaxy_shares(plan, size: int, world: int, work) -> tuple[dict, list[str]]:
    """Every Galaxy share list of `plan` (a galaxy.plan.Plan) for a group of `size` ranks: as given
    (checked) or an even split, larger shares first; and the problems, one line each. A list the
    methods do not use stays None when it cannot be made."""
    kv_group = work.heads // work.kv_heads
    att_tp = plan.att == "TP"
    cells = f"world {world} / (pp_deg {plan.pp} x dp_deg {plan.dp})"
    wanted = {  # field -> (total, what the total is, unit of the default split, fix)
        "heads": (work.heads, "num_attention_heads in the model config", kv_group if att_tp else 1,
                  "or set att_parallel_method to 'SP'"),
        "columns": (work.columns, "intermediate_size in the model config", 1,
                    "or set mlp_parallel_method to 'SP'"),
        "tokens": (work.tokens, "pad_size", 1, "or raise pad_size"),
        "decoder_tokens": (work.target_tokens, "target_pad_size (default pad_size)", 1,
                           "or raise target_pad_size"),
        "decode_columns": (work.columns, "intermediate_size in the model config", 1,
                           "or set mlp_parallel_method to 'TP'"),
    }
    out, problems = {}, []
    for name, (total, what, unit, fix) in wanted.items():
        key, given = SHARE_KEYS[name], getattr(plan, name)
        if total is None:       # no decoder: its shares mean nothing
            out[name] = None
            if given is not None:
                problems.append(f"{key} splits an encoder-decoder's decoder tokens, but the model "
                                "has no decoder; remove the key")
            continue
        if given is not None:
            problems += given_share_problems(key, given, size, total, what, cells,
                                              kv_group if name == "heads" and att_tp else 1, work)
            out[name] = tuple(given)
            continue
        try:
            out[name] = tokenwise_default(total, out["tokens"], size) if name == "decode_columns" \
                else tuple(even_split(total, size, unit))
        except ValueError:
            if plan.uses(name):
                units = f"{total // unit} KV groups" if unit > 1 else f"{total}"
                problems.append(
                    f"{key} is omitted and {what} ({units}) cannot be split over the "
                    f"{size} ranks of the Galaxy group ({cells}) without a rank getting "
                    f"none; use at most {total // unit} ranks per group {fix}")
            out[name] = None
    return out, problems
