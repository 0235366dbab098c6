"""apply_plan: make one model definition run under a plan's sub-block methods (galaxy.plan.Plan).

For every block it (1) sets the four Transitions from the layouts of the sub-blocks,
(2) shards TP sub-blocks to this rank's heads / MLP columns, (3) turns on the K/V gather of SP
attention, (4) routes sharded dropout to the rank's own random stream, and (5) tags every
parameter with its gradient rule (docs/design.md section 3):

  sharded     TP projections: the local gradient is complete for the local shard
  sum         replicated parameters applied to S activations: all-reduce over the group
  replicated  parameters applied to R activations: every rank already has the full gradient
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from galaxy.distributed.group import GalaxyGroup
from galaxy.distributed.transitions import Layout
from galaxy.layers.rng import ShardedDropout, ShardedRNG
from galaxy.layers.sharding import block_spans, shard_offset, slice_like
from galaxy.plan import Plan


@dataclass(frozen=True)
class ParamRule:
    kind: str                         # "sharded" | "sum" | "replicated"
    dim: int = 0                      # sharded: the split dimension
    sizes: tuple[int, ...] = ()       # sharded: elements per rank along dim (per block, see parts)
    # sharded: dim is `parts` equal blocks, each split by `sizes` (a fused projection, e.g. GPT-2's
    # c_attn [q; k; v]: parts 3); a rank holds its share of every block, in block order
    # (galaxy.layers.sharding.take_blocks), parts x sizes[rank] entries along dim.
    parts: int = 1

    def full_shape(self, shape) -> tuple[int, ...]:
        """The whole parameter's shape, from the shape of a rank's share."""
        shape = list(shape)
        if self.kind == "sharded":
            shape[self.dim] = self.parts * sum(self.sizes)
        return tuple(shape)

    def spans(self, rank: int) -> list[tuple[int, int]]:
        """(start, length) along dim of each piece rank holds, in the whole parameter, in the
        order the share holds them."""
        return block_spans(self.parts * sum(self.sizes), shard_offset(self.sizes, rank), self.sizes[rank],
                           self.parts)

    def local(self, full, rank: int):
        """Rank's share of a whole tensor shaped like the parameter (itself unless sharded)."""
        return full if self.kind != "sharded" else slice_like(full, self.dim, self.sizes, rank, self.parts)


REPLICATED = ParamRule("replicated")
SUM = ParamRule("sum")


def replicated_rule(layout: Layout, group: GalaxyGroup) -> ParamRule:
    """The rule of a whole (unsharded) parameter applied to activations in `layout`."""
    return SUM if layout == Layout.S and group.size > 1 else REPLICATED


def apply_plan(model: nn.Module, plan: Plan, group: GalaxyGroup,
               rng: ShardedRNG | None = None) -> dict[str, ParamRule]:
    """Modify `model` in place; returns the gradient rules and stores them, the plan, the group
    and the sharded RNG (None unless the group is split) in model.attached, for what is added to
    the model later (galaxy.pipeline, galaxy.peft).

    A layer whose `sequence` is "target" (an encoder-decoder's decoder layer) splits the group's
    decoder token shares; its XATT follows plan.method("xatt").
    """
    con = plan.con_layout
    con_rule = replicated_rule(con, group)
    rules: dict[str, ParamRule] = {}
    model.enter.set(Layout.R, con, sharded_consumer=False, group=group)
    rules.update(model.plan_head(con, group))
    for name in model.con_params:          # e.g. Llama's first RMSNorm, on the CON layout
        rules.update(_con_module_rules(name, getattr(model, name), con, group, rng))
    for name in getattr(model, "att_params", ()):    # e.g. T5's position bias: ATT's heads or tokens
        rules.update(_att_module_rules(name, getattr(model, name), plan, group))
    for i, layer in enumerate(model.layers):
        layer.set_overlap(plan)              # comm_chunks, kv_blocks
        g = group.decoder() if layer.sequence == "target" else group
        for name, to, frm in layer.parts():
            rules.update(_plan_sub_block(f"layers.{i}.{name}", getattr(layer, name), plan.method(name), to, frm,
                                         con, g, rng, con_rule))
        for name in layer.cons:
            rules.update(_con_module_rules(f"layers.{i}.{name}", getattr(layer, name), con, g, rng))

    for pname, _ in model.named_parameters():
        rules.setdefault(pname, REPLICATED)     # embeddings, pooler, classifier
    rules = {n: r for n, r in rules.items() if n in dict(model.named_parameters())}
    at = model.attached
    at.rules, at.plan, at.group = rules, plan, group
    at.sharded_rng = rng if group.size > 1 else None
    return rules


def _plan_sub_block(prefix: str, block: nn.Module, method: str, to, frm, con: Layout, group: GalaxyGroup,
                    rng, con_rule: ParamRule) -> dict[str, ParamRule]:
    """Set a TP or SP sub-block's transitions, shard it, route its dropout; its parameters' rules."""
    rules = {}
    tp = method == "TP"
    to.set(con, Layout.R if tp else Layout.S, sharded_consumer=tp, group=group)
    frm.set(Layout.P if tp else Layout.S, con, sharded_consumer=False, group=group)
    if tp and group.size > 1:
        shares = group.columns if prefix.endswith(".mlp") else group.heads
        # {param: (dim, sizes) or (dim, sizes, parts)}
        for pname, (dim, sizes, *parts) in block.shard_tp(shares, group.rank).items():
            rules[f"{prefix}.{pname}"] = ParamRule("sharded", dim, tuple(sizes), *parts)
    for pname, _ in block.named_parameters():
        rules.setdefault(f"{prefix}.{pname}", REPLICATED if tp or group.size == 1 else SUM)
    # The output bias is added after the transition, on the CON layout.
    rules[f"{prefix}.{block.deferred_bias}"] = con_rule
    if not tp and group.size > 1 and hasattr(block, "sequence_parallel"):
        block.sequence_parallel(group)       # ATT: K/V gathered, own query rows
    if group.size > 1 and rng is not None:
        block.draw_dropout_from(rng)         # own heads, columns or tokens
    return rules


def _con_module_rules(prefix: str, module: nn.Module, con: Layout, group: GalaxyGroup, rng) -> dict[str, ParamRule]:
    """A module on the CON layout (a CON, a first norm): the CON rule; under CON SP its dropout
    draws each rank's own mask."""
    if con == Layout.S and group.size > 1 and rng is not None and isinstance(module, ShardedDropout):
        module.draw_dropout_from(rng)
    rule = replicated_rule(con, group)
    return {f"{prefix}.{pname}": rule for pname, _ in module.named_parameters()}


def _att_module_rules(prefix: str, module: nn.Module, plan: Plan, group: GalaxyGroup) -> dict[str, ParamRule]:
    """A model-level module every ATT applies (T5's relative position bias): split by heads
    like a TP ATT (shard_tp), or whole and summed like an SP ATT's parameters."""
    if plan.att == "TP" and group.size > 1:
        return {f"{prefix}.{pname}": ParamRule("sharded", dim, tuple(sizes))
                for pname, (dim, sizes) in module.shard_tp(group.heads, group.rank).items()}
    rule = SUM if group.size > 1 else REPLICATED
    return {f"{prefix}.{pname}": rule for pname, _ in module.named_parameters()}
