"""T5's relative position bias: a learnt scalar per head and bucket of key - query distance,
added to the attention scores of every layer of a stack.

Buckets: half of them hold exact distances 0 .. n/2 - 1, the other half distances up to
max_distance on a log scale (larger ones share the last bucket). A bidirectional stack (the
encoder) spends half of the buckets on keys after the query; a causal one (the decoder) sees
only keys at or before it and uses every bucket for those.

The table is [buckets, heads], a column per head, so a plan splits it like the heads it biases:
under a TP ATT each rank keeps its heads' columns (shard_tp) and its bias is [1, own heads, S, S];
under an SP ATT every rank holds the whole table and its queries cut the rows they need.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from galaxy.layers.sharding import shard_offset, keep_slice


def relative_buckets(distance: torch.Tensor, bidirectional: bool, buckets: int, max_distance: int) -> torch.Tensor:
    """Bucket of each key - query distance (a long tensor), in [0, buckets)."""
    out = torch.zeros_like(distance)
    if bidirectional:
        buckets //= 2
        out = out + (distance > 0).long() * buckets       # keys after the query: the upper half
        distance = distance.abs()
    else:
        distance = (-distance).clamp_min(0)                # keys at or before the query
    exact = buckets // 2
    log_scale = exact + (torch.log(distance.float() / exact) / math.log(max_distance / exact)
                         * (buckets - exact)).long()
    return out + torch.where(distance < exact, distance, log_scale.clamp_max(buckets - 1))


class RelativePositionBias(nn.Module):
    def __init__(self, buckets: int, heads: int, max_distance: int, bidirectional: bool):
        super().__init__()
        self.relative_attention_bias = nn.Embedding(buckets, heads)     # Hugging Face's name
        self.buckets, self.max_distance, self.bidirectional = buckets, max_distance, bidirectional

    def shard_tp(self, shares: tuple[int, ...], rank: int) -> dict:
        """Keep this rank's heads' columns. Returns {param: (dim, per-rank sizes)}."""
        keep_slice(self.relative_attention_bias, "weight", 1, shard_offset(shares, rank), shares[rank])
        return {"relative_attention_bias.weight": (1, tuple(shares))}

    def forward(self, queries: int, keys: int, query_start: int = 0):
        """-> [1, heads, queries, keys]: the bias of key j (positions from 0) for the query at
        position query_start + i (a decode step's one query: query_start = its position)."""
        device = self.relative_attention_bias.weight.device
        query_positions = torch.arange(query_start, query_start + queries, device=device)
        distance = torch.arange(keys, device=device)[None, :] - query_positions[:, None]
        bucket = relative_buckets(distance, self.bidirectional, self.buckets, self.max_distance)
        return self.relative_attention_bias(bucket).permute(2, 0, 1).unsqueeze(0)
