"""Which layers each pipeline stage runs: contiguous ranges from stage_num_hidden_layers_list."""
from __future__ import annotations

from itertools import accumulate


def stage_layer_ranges(num_hidden_layers: int, pp: int,
                       stage_num_hidden_layers_list: list[int] | None = None) -> list[range]:
    """Global layer indices of every stage, in stage order.

    None splits as evenly as possible, earlier stages taking the remainder (the last stage also
    runs the head). Uneven lists are allowed; every stage needs at least one layer.
    """
    counts = stage_num_hidden_layers_list
    if counts is None:
        if num_hidden_layers < pp:
            raise ValueError(f"{num_hidden_layers} hidden layers cannot fill {pp} pipeline stages "
                             f"(every stage needs one); lower pp_deg")
        base, extra = divmod(num_hidden_layers, pp)
        counts = [base + (i < extra) for i in range(pp)]
    counts = list(counts)
    if len(counts) != pp:
        raise ValueError(f"stage_num_hidden_layers_list has {len(counts)} entries but the pipeline "
                         f"has {pp} stages (pp_deg); give one entry per stage")
    if any(c < 1 for c in counts):
        raise ValueError(f"stage_num_hidden_layers_list {counts}: every stage needs at least one layer")
    if sum(counts) != num_hidden_layers:
        raise ValueError(f"stage_num_hidden_layers_list {counts} sums to {sum(counts)} but the model "
                         f"has num_hidden_layers {num_hidden_layers}")
    ends = list(accumulate(counts))
    return [range(end - c, end) for c, end in zip(counts, ends)]
