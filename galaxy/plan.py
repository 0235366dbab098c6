"""The plan: every choice of how one model is spread over the devices, in one torch-free type.

    mesh        pp x dp x group: pipeline stages, data-parallel replicas of each stage, and the
                Galaxy ranks that split every block between them (group = world / (pp * dp));
                rank = (pp_index * dp + dp_index) * group + galaxy_rank (galaxy.distributed.mesh)
    methods     how each sub-block runs in the group: att TP|SP, mlp TP|SP, con SP|None, and an
                encoder-decoder's cross-attention xatt TP|SP (None: as att)
    shares      per Galaxy rank: query heads (a TP ATT or XATT), MLP columns (a TP MLP), tokens
                (SP), an encoder-decoder's decoder tokens (its target sequence, SP), and the MLP
                columns an SP MLP computes while decoding one token (decode_columns)
                per data-parallel replica: rows of every global batch (replica_rows; None: even)
    pipeline    layers per stage, micro-batches per step (the pipeline's when pp > 1, gradient
                accumulation's otherwise), the schedule (gpipe | 1f1b) and 1f1b's warm-up forwards
                per stage (warmup; None: pp - p, torch's)
    placement   which launched process holds each mesh position (rank_order; None: the launch
                rank is the position): a slow device can take the first stage, which waits for
                no other stage's fill and drain
    memory      the layers that recompute in backward (activation checkpointing), and whether the
                replicas shard parameters, gradients and optimizer state (dp_sharding, FSDP2)
    overlap     comm_chunks: a TP sub-block's collectives in chunks of the sequence; kv_blocks: SP
                attention over the own keys while the other ranks' K/V travel; batch_streams: a
                micro-batch's rows in streams, one's collectives travelling while another computes;
                prefill_chunks (generation): a prompt crossing the pipeline in token chunks

A Plan reads and writes the config's flat keys (`from_keys` / `to_keys`: today's JSON and
Galaxy-LM's keep their names), fills in what a config leaves out (`resolve`: even splits, larger
shares first) and lists its own problems for a world, a model and a batch, one line each naming
the key and the fix (the share lists' checks and defaults: galaxy.plan_shares; the pipeline
keys': galaxy.plan_pipeline). Everything that splits a model (the config, the mesh, apply_plan, the
runners, the planner, checkpoints' layout record, the profiler) takes this one type.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from itertools import accumulate
from typing import NamedTuple

from galaxy.plan_pipeline import pipeline_problems, rank_order_problems
from galaxy.plan_shares import (SHARE_KEYS, even_split, galaxy_shares, microbatch_problems, share_problems,
                                tokenwise_default)

__all__ = ["Layout", "Plan", "PlanError", "Workload", "even_split", "recompute_layers"]


class Layout(str, Enum):
    """How an activation between sub-blocks lies on the Galaxy group (docs/design.md section 2)."""
    R = "R"     # replicated: every rank holds the full [b, S, h]
    S = "S"     # sequence-sharded: rank r holds its tokens [b, s_r, h]
    P = "P"     # partial: every rank holds [b, S, h]; the true value is the sum over ranks

METHODS = {"att": ("TP", "SP"), "mlp": ("TP", "SP"), "con": ("SP", "None"), "xatt": ("TP", "SP")}
SCHEDULES = ("gpipe", "1f1b")
# dp_sharding: replicas hold whole copies (DDP), or FSDP2 shards them and frees each layer's
# gathered parameters after its forward ("full", ZeRO-3 like) or keeps them to backward ("no_reshard").
DP_SHARDING = ("none", "full", "no_reshard")
# The named method combinations (att, mlp, con); "galaxy" is the default plan.
PRESETS = {
    "tp": ("TP", "TP", "None"),
    "sp": ("SP", "SP", "SP"),
    "galaxy": ("TP", "TP", "SP"),     # Megatron TP+SP, with uneven shares
    "galaxy2": ("TP", "SP", "SP"),
}

# Flat config key -> Plan field. The micro-batches have two keys: num_microbatches with a
# pipeline, grad_accum_steps without one.
FIELD_OF_KEY = {
    "att_parallel_method": "att", "mlp_parallel_method": "mlp", "con_parallel_method": "con",
    "pp_deg": "pp", "dp_deg": "dp",
    "tp_num_attention_heads_list": "heads", "tp_intermediate_size_list": "columns", "seq_scatter_list": "tokens",
    "stage_num_hidden_layers_list": "stages", "num_microbatches": "microbatches",
    "grad_accum_steps": "microbatches", "pipeline_schedule": "schedule",
    "activation_checkpointing": "checkpoint", "dp_sharding": "dp_sharding",
    "comm_chunks": "comm_chunks", "kv_blocks": "kv_blocks", "batch_streams": "batch_streams",
    "prefill_chunks": "prefill_chunks",
    "xatt_parallel_method": "xatt", "decoder_seq_scatter_list": "decoder_tokens", "dp_batch_list": "replica_rows",
    "decode_intermediate_size_list": "decode_columns",
    "pipeline_warmup_list": "warmup", "mesh_rank_order": "rank_order",
}

class Workload(NamedTuple):
    """What a plan is checked and resolved against: the model's sizes and the batch."""
    heads: int          # query heads (num_attention_heads)
    kv_heads: int       # key/value heads (num_key_value_heads; = heads without grouped-query attention)
    columns: int        # MLP intermediate size
    layers: int         # transformer layers
    tokens: int         # sequence length (pad_size); an encoder-decoder's source length
    rows: int | None = None      # global batch rows (batch_size); None: not checked
    target_tokens: int | None = None     # an encoder-decoder's decoder length; None: no decoder

    @staticmethod
    def of(shape: dict, tokens: int, rows: int | None = None, target_tokens: int | None = None) -> "Workload":
        """From a model shape (galaxy.models.shape.read_model_shape); target_tokens counts only
        for an encoder-decoder (shape["is_encoder_decoder"])."""
        return Workload(shape["num_attention_heads"], shape["num_key_value_heads"], shape["intermediate_size"],
                        shape["num_hidden_layers"], tokens, rows,
                        target_tokens if shape.get("is_encoder_decoder") else None)


@dataclass(frozen=True)
class Plan:
    att: str = "TP"                           # TP | SP
    mlp: str = "TP"                           # TP | SP
    con: str = "SP"                           # SP | None
    pp: int = 1                               # pipeline stages
    dp: int = 1                               # data-parallel replicas of every stage
    heads: tuple[int, ...] | None = None      # query heads per Galaxy rank; None: even
    columns: tuple[int, ...] | None = None    # MLP columns per Galaxy rank; None: even
    tokens: tuple[int, ...] | None = None     # tokens per Galaxy rank; None: even
    stages: tuple[int, ...] | None = None     # layers per pipeline stage; None: even
    microbatches: int = 1                     # per optimizer step (pipeline or accumulation)
    schedule: str = "1f1b"                    # gpipe | 1f1b (pp > 1)
    # "none", "full", a number of leading layers, or layer indices; resolved: the indices
    checkpoint: str | int | tuple[int, ...] = "none"
    dp_sharding: str = "none"                 # none | full | no_reshard
    comm_chunks: int = 1
    kv_blocks: bool = False
    batch_streams: int = 1                    # streams of a micro-batch's rows (galaxy.distributed.streams)
    xatt: str | None = None                   # TP | SP; None: as att (resolved: concrete)
    decoder_tokens: tuple[int, ...] | None = None   # decoder tokens per Galaxy rank; None: even
    replica_rows: tuple[int, ...] | None = None     # rows of a global batch per DP replica; None: even
    decode_columns: tuple[int, ...] | None = None   # SP MLP columns per rank per decoded token; None: as tokens
    prefill_chunks: int = 1                   # generation: the prompt's token chunks (galaxy.inference.engine)
    # 1f1b: forwards each stage runs before its first backward; None: pp - p (torch's 1F1B)
    warmup: tuple[int, ...] | None = None
    # the launch rank holding each mesh position (rank formula above); None: position = launch rank
    rank_order: tuple[int, ...] | None = None

    # --- the flat keys -----------------------------------------------------------------------

    @staticmethod
    def preset(name: str, **rest) -> "Plan":
        att, mlp, con = PRESETS[name]
        return Plan(att=att, mlp=mlp, con=con, **rest)

    @staticmethod
    def from_keys(keys) -> "Plan":
        """From an object or dict holding the flat config keys (absent ones keep the defaults)."""
        get = keys.get if isinstance(keys, dict) else lambda k, d=None: getattr(keys, k, d)
        values = {}
        for key, name in FIELD_OF_KEY.items():
            value = get(key, None)
            if value is None or name == "microbatches":
                continue
            values[name] = tuple(value) if isinstance(value, list) else value
        pipelined = (get("pp_deg", 1) or 1) > 1
        micro = get("num_microbatches" if pipelined else "grad_accum_steps", None)
        if micro is not None:
            values["microbatches"] = micro
        return Plan(**values)

    def to_keys(self, layers: int | None = None) -> dict:
        """The flat config keys of this plan; a share list only where a split uses it (and the
        group has more than one rank, once resolved). layers: the model's, to write a resolved
        checkpoint as "full" or a leading count."""
        keys = {"att_parallel_method": self.att, "mlp_parallel_method": self.mlp,
                "con_parallel_method": self.con, "pp_deg": self.pp, "dp_deg": self.dp,
                "activation_checkpointing": self.checkpoint_key(layers)}
        for name, key in SHARE_KEYS.items():
            shares = getattr(self, name)
            if shares is not None and self.uses(name) and len(shares) > 1:
                keys[key] = list(shares)
        if self.pp > 1:
            keys.update(num_microbatches=self.microbatches, pipeline_schedule=self.schedule)
            if self.stages is not None:
                keys["stage_num_hidden_layers_list"] = list(self.stages)
            if self.warmup is not None:
                keys["pipeline_warmup_list"] = list(self.warmup)
        elif self.microbatches > 1:
            keys["grad_accum_steps"] = self.microbatches
        if self.dp > 1:
            keys["dp_sharding"] = self.dp_sharding
            if self.replica_rows is not None:
                keys["dp_batch_list"] = list(self.replica_rows)
        keys.update({k: getattr(self, k) for k in ("comm_chunks", "batch_streams", "prefill_chunks")
                     if getattr(self, k) > 1})
        if self.kv_blocks:
            keys["kv_blocks"] = True
        if self.xatt is not None:
            keys["xatt_parallel_method"] = self.xatt
        if self.rank_order is not None and self.rank_order != tuple(range(len(self.rank_order))):
            keys["mesh_rank_order"] = list(self.rank_order)
        return keys

    def stage_warmup(self, p: int) -> int:
        """Forwards stage p runs before its first backward: m under gpipe (or without a pipeline),
        else its pipeline_warmup_list entry or pp - p (torch's 1F1B), at most m."""
        m = self.microbatches
        if self.pp == 1 or self.schedule == "gpipe":
            return m
        return min(m, self.warmup[p] if self.warmup is not None else self.pp - p)

    def position_of(self, launch_rank: int) -> int:
        """The mesh position (the process group's rank) of the process launched as launch_rank."""
        return launch_rank if self.rank_order is None else self.rank_order.index(launch_rank)

    def launch_rank(self, position: int) -> int:
        """The launch rank of the process holding mesh position `position`."""
        return position if self.rank_order is None else self.rank_order[position]

    def checkpoint_key(self, layers: int | None = None):
        """activation_checkpointing as a config writes it: "none", "full", a number of leading
        layers (no pipeline), or the layer indices."""
        if not isinstance(self.checkpoint, tuple):
            return self.checkpoint
        if not self.checkpoint:
            return "none"
        if layers is not None and len(self.checkpoint) == layers:
            return "full"
        if self.pp == 1 and self.checkpoint == tuple(range(len(self.checkpoint))):
            return len(self.checkpoint)
        return list(self.checkpoint)

    # --- what a resolved plan answers ----------------------------------------------------------

    def uses(self, share: str) -> bool:
        """Whether a split of this kind ("heads", "columns", "tokens", "decoder_tokens") is in use."""
        if share == "heads":
            return self.att == "TP" or self.xatt == "TP"
        if share == "columns":
            return self.mlp == "TP"
        if share == "decode_columns":
            return self.mlp == "SP"
        return self.att == "SP" or self.mlp == "SP" or self.con == "SP" or (share == "decoder_tokens"
                                                                             and self.xatt == "SP")

    def splits_prompt(self) -> bool:
        """Whether generation pads prompts to pad_size: tokens split, or XATT SP caching the memory's by them."""
        return self.group > 1 and (self.uses("tokens") or self.xatt == "SP")

    def decode_mlp_columns(self, width: int | None = None) -> tuple[int, ...]:
        """A decode step's MLP columns per rank: TP's shares, SP's decode_columns (or their default)."""
        if self.mlp == "TP":
            return self.columns
        return self.decode_columns or tokenwise_default(width or sum(self.columns), self.tokens, len(self.tokens))

    def method(self, kind: str) -> str:
        """The method of sub-block kind "att", "mlp", "con" or "xatt" (XATT: as ATT unless given)."""
        return getattr(self, kind) if kind != "xatt" or self.xatt is not None else self.att

    @property
    def con_layout(self) -> Layout:
        """The residual stream's layout (the CONs'): token shards under CON SP, else replicated."""
        return Layout.S if self.con == "SP" else Layout.R

    @property
    def group(self) -> int:
        """Galaxy ranks per group (a resolved plan's)."""
        return len(self.tokens)

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.group

    @property
    def recomputed(self) -> frozenset[int]:
        """The layers that recompute in backward (of a plan whose stages are known)."""
        if isinstance(self.checkpoint, tuple):
            return frozenset(self.checkpoint)
        return recompute_layers(self.checkpoint, sum(self.stages))

    def stage_layers(self) -> list[range]:
        """Global layer indices of every stage, in stage order (a resolved plan's)."""
        ends = list(accumulate(self.stages))
        return [range(end - n, end) for n, end in zip(self.stages, ends)]

    def recomputed_in_stage(self, p: int) -> int:
        """How many of stage p's layers recompute (a plan whose stages are known)."""
        start = sum(self.stages[:p])
        layers = range(start, start + self.stages[p])
        if isinstance(self.checkpoint, tuple):      # resolved: the planner's hot path
            return sum(i in layers for i in self.checkpoint)
        return len(self.recomputed.intersection(layers))

    def with_stage_checkpoints(self, counts) -> "Plan":
        """This plan recomputing the first counts[p] layers of every stage p (resolved)."""
        picked = [i for layers, n in zip(self.stage_layers(), counts) for i in layers[:n]]
        return replace(self, checkpoint=tuple(picked))

    # --- filling in and checking ------------------------------------------------------------------

    def key_problems(self) -> list[str]:
        """What is wrong with the keys whatever the world and model: one line each."""
        problems = []
        for name, key in (("pp", "pp_deg"), ("dp", "dp_deg"), ("microbatches", None), ("comm_chunks", "comm_chunks"),
                          ("batch_streams", "batch_streams"), ("prefill_chunks", "prefill_chunks")):
            value = getattr(self, name)
            if value < 1:
                key = key or ("num_microbatches" if self.pp > 1 else "grad_accum_steps")
                problems.append(f"{key} must be at least 1, got {value}")
        for name, key in (*SHARE_KEYS.items(), ("replica_rows", "dp_batch_list"),
                          ("stages", "stage_num_hidden_layers_list")):
            values = getattr(self, name)
            if values is not None and not values:
                problems.append(f"{key} must not be empty; give one entry per rank or remove the key")
            if name != "stages":
                for i, v in enumerate(values or ()):
                    if v < 1:
                        problems.append(f"{key}[{i}] must be at least 1 (every rank needs a share), got {v}")
        return problems

    def problems(self, world: int, work: Workload) -> list[str]:
        """Every reason this plan cannot run on `world` processes for `work`, one line each."""
        problems = []
        cells = self.pp * self.dp
        if world % cells:
            problems.append(f"--world {world} is not divisible by pp_deg {self.pp} x dp_deg "
                            f"{self.dp} = {cells}; use a multiple of {cells} ranks or change "
                            f"pp_deg/dp_deg")
        problems += share_problems(self.replica_rows, self.dp, work.rows)
        problems += microbatch_problems(self.replica_rows, self.dp, work.rows, self.microbatches, self.pp > 1)
        if work.rows is not None and work.rows % self.dp and self.replica_rows is None:
            problems.append(f"batch_size {work.rows} is not divisible by dp_deg {self.dp}; "
                            f"use a multiple of {self.dp}")
        problems += pipeline_problems(self, work)
        problems += rank_order_problems(self.rank_order, world)
        try:
            recompute_layers(self.checkpoint, work.layers)
        except PlanError as e:
            problems += e.problems
        if self.dp_sharding != "none" and self.dp == 1:
            problems.append(f"dp_sharding is '{self.dp_sharding}' but dp_deg is 1: it shards the data-parallel "
                            f"replicas' parameters over dp_deg > 1 replicas; set dp_deg or remove dp_sharding")
        if not world % cells:
            problems += galaxy_shares(self, world // cells, world, work)[1] + self._chunk_problems(world // cells, work)
        return problems

    def _chunk_problems(self, group: int, work: Workload) -> list[str]:
        """prefill_chunks cuts a causal LM's prompt by tokens: no pass may split them over the group."""
        n = self.prefill_chunks
        if n > 1 and work.target_tokens is not None:
            return [f"prefill_chunks {n} cuts a causal LM's prompt; an encoder-decoder's encoder reads it whole: "
                    "remove prefill_chunks"]
        if n > 1 and group > 1 and self.uses("tokens"):
            return [f"prefill_chunks {n} cuts the prompt into chunks, but an SP sub-block splits every pass's tokens "
                    "over the Galaxy group (shares made for pad_size): set prefill_chunks to 1, or make ATT and MLP "
                    "TP and con_parallel_method None"]
        return []

    def resolve(self, world: int, work: Workload) -> "Plan":
        """This plan with every share, stage and recomputed layer concrete; PlanError naming
        every problem. A share list the methods do not use stays None when it cannot be made."""
        problems = self.key_problems() + self.problems(world, work)
        if problems:
            raise PlanError(*problems)
        shares = galaxy_shares(self, world // (self.pp * self.dp), world, work)[0]
        stages = self.stages or tuple(even_split(work.layers, self.pp))
        xatt = self.method("xatt") if work.target_tokens is not None else self.xatt
        return replace(self, **shares, stages=stages, xatt=xatt,
                       checkpoint=tuple(sorted(recompute_layers(self.checkpoint, work.layers))))


class PlanError(ValueError):
    """Problems of a plan: one line each (`problems`), joined by newlines."""

    def __init__(self, *problems: str):
        self.problems = list(problems)
        super().__init__("\n".join(problems))


def recompute_layers(spec, num_layers: int) -> frozenset[int]:
    """The layers activation checkpointing recomputes: spec "none", "full", a number of leading
    layers or layer indices (config key activation_checkpointing)."""
    if spec == "none":
        return frozenset()
    if spec == "full":
        return frozenset(range(num_layers))
    if isinstance(spec, int):
        if not 0 <= spec <= num_layers:
            raise PlanError(f"activation_checkpointing {spec} is not a number of layers of the model's "
                            f"{num_layers}; use 0..{num_layers}, \"full\" or a list of layer indices")
        return frozenset(range(spec))
    bad = [i for i in spec if not 0 <= i < num_layers]
    if bad:
        raise PlanError(f"activation_checkpointing names layer {bad[0]}, but the model's layers are "
                        f"0..{num_layers - 1}; fix the list")
    return frozenset(spec)
