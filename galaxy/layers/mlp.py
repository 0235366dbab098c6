"""MLP, the one feed-forward sub-block every family builds, under its Hugging Face names.

Two-matrix (BERT's up / down, GPT-2's c_fc / c_proj):   down(act(up(x)))
gated, SwiGLU (Llama's gate_proj / up_proj / down_proj): down(act(gate(x)) * up(x))

The output projection is an OutputProjection: its bias is returned, not added, and CON adds it
after the output's layout transition. `dropout_p`: dropout on the hidden activation before the
output projection (BART's activation_dropout, T5's dropout_rate), drawn in `rng_scope`: under a
plan the activation is this rank's columns or tokens, so the plan routes it to the rank's stream.
Under TP each rank keeps its columns of the intermediate width: gate and up are column-parallel,
down row-parallel (galaxy.layers.sharding). Under SP every rank holds the whole MLP, so while
decoding one token it can compute only some columns (`decode_on_columns`): the rows of gate and up
and the columns of down, views of the weights it holds, and an output that is a partial sum, as a
TP MLP's.
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor
from torch import nn

from galaxy.layers.linear import OutputProjection
from galaxy.layers.rng import ShardedDropout
from galaxy.layers.sharding import shard_column_parallel, shard_row_parallel


class FeedForward(ShardedDropout, nn.Module):
    """names: (up, down) or (gate, up, down), the projections' names in the family's checkpoints;
    act: the activation module (transformers' ACT2FN[...] of the config)."""

    def __init__(self, hidden: int, intermediate: int, act: nn.Module, *, names: tuple[str, ...], bias: bool = True,
                 dropout_p: float = 0.0):
        super().__init__()
        if len(names) not in (2, 3):
            raise ValueError(f"an MLP's names are (up, down) or (gate, up, down), got {names}")
        self.names = names
        *columns, down = names
        for name in columns:
            setattr(self, name, nn.Linear(hidden, intermediate, bias=bias))
        setattr(self, down, OutputProjection(intermediate, hidden, bias=bias))
        self.act = act
        self.dropout_p = dropout_p
        # While decoding on a column share: ([(weight, bias) of gate/up's rows], down's columns),
        # views into the whole weights; None: the whole MLP.
        self.column_views: tuple[list[tuple[Tensor, Tensor | None]], Tensor] | None = None

    @property
    def deferred_bias(self) -> str:
        return f"{self.names[-1]}.bias"

    def shard_tp(self, shares: tuple[int, ...], rank: int) -> dict:
        """Keep this rank's intermediate columns. Returns {param: (dim, per-rank sizes)}."""
        start, count = sum(shares[:rank]), shares[rank]
        *columns, down = self.names
        specs = {}
        for name in columns:
            proj = getattr(self, name)
            shard_column_parallel(proj, start, count)
            specs[f"{name}.weight"] = (0, shares)
            if proj.bias is not None:
                specs[f"{name}.bias"] = (0, shares)
        shard_row_parallel(getattr(self, down), start, count)
        return {**specs, f"{down}.weight": (1, shares)}

    @property
    def intermediate(self) -> int:
        """The intermediate width this rank holds (a TP rank: its columns)."""
        return getattr(self, self.names[-1]).weight.shape[1]

    def splits_columns(self) -> bool:
        """Whether decode_on_columns can serve this MLP: its projections are plain (a LoRA-wrapped
        one adds its own update, which the views would leave out)."""
        return all(type(getattr(self, n)) in (nn.Linear, OutputProjection) for n in self.names)

    def decode_on_columns(self, start: int | None, count: int = 0) -> None:
        """From now on compute only intermediate columns [start, start + count): gate / up rows
        [count, h] and down's columns [h, count] (views, no copy: made once per generate call), the
        output a partial sum over the column shares. start None: the whole MLP again."""
        if start is None:
            self.column_views = None
            return
        *columns, down = (getattr(self, name) for name in self.names)
        rows = [(p.weight.narrow(0, start, count), None if p.bias is None else p.bias.narrow(0, start, count))
                for p in columns]
        self.column_views = rows, down.weight.narrow(1, start, count)

    def _columns_forward(self, x):
        # x: [b, 1, h] -> this share's partial output [b, 1, h]; [b, 1, count] in between
        rows, down = self.column_views
        if len(rows) == 1:
            inner = self.act(F.linear(x, *rows[0]))
        else:
            inner = self.act(F.linear(x, *rows[0])) * F.linear(x, *rows[1])
        return F.linear(inner, down)

    def forward(self, x):
        # x: [b, s, h] -> ([b, s, h] without down's bias, down's bias); [b, s, i] in between
        *columns, down = (getattr(self, name) for name in self.names)
        if self.column_views is not None:
            return self._columns_forward(x), down.bias
        if len(columns) == 1:
            inner = self.act(columns[0](x))
        else:
            gate, up = columns
            inner = self.act(gate(x)) * up(x)
        if self.training and self.dropout_p > 0:
            with self.rng_scope():
                inner = F.dropout(inner, self.dropout_p, True)
        return down(inner), down.bias
