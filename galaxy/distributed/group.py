"""The Galaxy group: the ranks that split one transformer block between them.

A GalaxyGroup carries the process group and every per-rank share a plan gives (galaxy.plan.Plan's
heads, columns and tokens): how many attention heads, MLP columns and sequence tokens each rank
owns. Shares may be uneven. A group of size 1 (serial training) has `pg=None`; every collective
returns early for it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
import torch.distributed as dist


@dataclass(frozen=True)
class GalaxyGroup:
    rank: int                      # this process's index inside the group
    size: int
    pg: dist.ProcessGroup | None   # None when size == 1
    heads: tuple[int, ...]         # query heads per rank (TP attention)
    columns: tuple[int, ...]       # MLP columns per rank (TP MLP)
    tokens: tuple[int, ...]        # tokens per rank (SP sub-blocks)
    # An encoder-decoder's decoder tokens per rank (its target sequence); None: no decoder.
    decoder_tokens: tuple[int, ...] | None = None
    # The decoder's view (decoder()) only: the encoder's token shares, i.e. the memory's, by which
    # an XATT under SP caches the memory's K/V while generating (galaxy.layers.cross_attention).
    source_tokens: tuple[int, ...] | None = None

    @staticmethod
    def serial(num_heads: int, intermediate_size: int, seq_len: int) -> "GalaxyGroup":
        return GalaxyGroup(0, 1, None, (num_heads,), (intermediate_size,), (seq_len,))

    def decoder(self) -> "GalaxyGroup":
        """This group as the decoder's layers see it: its token shares are the decoder's, the
        encoder's kept as source_tokens. A one-rank group (no shares to speak of) is itself."""
        if self.size == 1:
            return self
        if self.decoder_tokens is None:
            raise ValueError("this Galaxy group has no decoder token shares (the plan's decoder_tokens)")
        return replace(self, tokens=self.decoder_tokens, source_tokens=self.tokens)

    @property
    def token_offset(self) -> int:
        """Global position of this rank's first token."""
        return sum(self.tokens[: self.rank])
