"""One token per row out of a stream that may be sequence-sharded: what the sequence classifiers
that read a chosen token (Llama's last kept token, BART's and T5's last EOS) share."""
from __future__ import annotations

import torch

from galaxy.distributed.transitions import reduce_to_replicated


def pooled_tokens(x: torch.Tensor, at: torch.Tensor, group=None) -> torch.Tensor:
    """x [b, s_con, h] (the CON layout), at [b] global positions -> [b, h], whole on every rank.

    group None: x holds the whole sequence, a plain gather. Otherwise (CON SP) row i's token lives
    on the one rank whose shard [o_r, o_r + s_r) holds at[i]: each rank takes the tokens it owns
    (zeros for the other rows) and a sum over the group (reduce_to_replicated: all-reduce forward,
    identity backward) gives every rank all b tokens exactly (one non-zero term per row), one
    [b, h] collective; the gradient, replicated like the loss, reaches each token on its owner only.
    """
    rows, at = torch.arange(x.shape[0], device=x.device), at.to(x.device)
    if group is None:
        return x[rows, at]
    local = at - group.token_offset
    own = (local >= 0) & (local < x.shape[1])
    picked = x[rows, local.clamp(0, x.shape[1] - 1)]
    return reduce_to_replicated(torch.where(own[:, None], picked, torch.zeros_like(picked)), group)
