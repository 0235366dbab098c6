"""The profile of one training step, as data: per module, per sub-block, totals, communication.

Units: FLOPs and MACs are counts for the whole batch of one step on this rank (2 FLOPs per
multiply-add); bytes are bytes; latencies are seconds (median over the timed repeats).
`fwd_flops`, `bwd_flops` and `macs` count matrix products only (linear layers, attention scores
and attention-weighted values); element-wise work (norms, activations, softmax, residual adds,
dropout) is in `*_elementwise_flops`. See galaxy/profiler/formulas.py for the convention.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

SCHEMA_VERSION = 1


@dataclass
class ModuleStats:
    name: str                      # qualified name in the model ("" is the model itself)
    type: str
    depth: int                     # 0 for the model, 1 for its children, ...
    params: int                    # parameters held on this rank (inclusive of children)
    fwd_flops: int = 0             # inclusive of children, like every figure below
    bwd_flops: int = 0
    macs: int = 0                  # forward multiply-adds (fwd_flops / 2)
    fwd_elementwise_flops: int = 0
    bwd_elementwise_flops: int = 0
    act_bytes: int = 0             # saved for the backward
    fwd_latency_s: float = 0.0
    bwd_latency_s: float = 0.0
    called: bool = True            # False: its parent applies its weights (F.linear(x, self.out.weight))


@dataclass
class SubBlockStats:
    layer: int
    name: str                      # att | con1 | [xatt | conx] | mlp | con2 (module layers.{layer}.{name})
    kind: str                      # ATT | CON | XATT | MLP
    params: int
    fwd_flops: int
    bwd_flops: int
    macs: int
    fwd_elementwise_flops: int
    bwd_elementwise_flops: int
    act_bytes: int
    fwd_latency_s: float
    bwd_latency_s: float


@dataclass
class Totals:
    params: int
    fwd_flops: int
    bwd_flops: int
    macs: int
    elementwise_flops: int          # forward element-wise work
    bwd_elementwise_flops: int
    act_bytes: int
    fwd_latency_s: float
    bwd_latency_s: float


@dataclass
class ProfileReport:
    model: str                     # class name of the model
    batch_size: int
    seq_len: int
    rank: int
    world: int
    plan: dict | None              # {"att", "mlp", "con"} or None (serial / foreign model)
    totals: Totals
    modules: list[ModuleStats]
    sub_blocks: list[SubBlockStats]
    comm: dict                     # galaxy.profiler.comm.CommStats.to_dict()
    notes: list[str] = field(default_factory=list)
    fwd_ops: dict = field(default_factory=dict)   # op -> forward FLOPs (matrix and element-wise)
    bwd_ops: dict = field(default_factory=dict)
    # Bytes this rank holds for training (galaxy.profiler.profile.memory_of): weights, grads,
    # optimizer (divided over dp_shards replicas under dp_sharding), activations (saved for backward).
    memory: dict = field(default_factory=dict)

    def module(self, name: str) -> ModuleStats:
        for m in self.modules:
            if m.name == name:
                return m
        raise KeyError(name)

    def to_dict(self) -> dict:
        return {"schema_version": SCHEMA_VERSION, **asdict(self)}

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)
