"""LoRA (Hu et al. 2021): a frozen projection plus a trainable low-rank update.

    y = W x + b + scaling * B A dropout(x),   A: [r, in], B: [out, r], scaling = alpha / r

as peft computes it. Under a plan the update is split like the projection it belongs to:

  column-parallel W (rows sharded: query/key/value, up, gate)  B sharded by rows like W; A whole.
      y_shard = W_shard x + scaling * B_shard (A x). A's gradient sums over the ranks' B_shards:
      rule "sum". A fused W (GPT-2's c_attn, rows [q; k; v]) shards B's rows block by block, as
      its rule says (ParamRule.parts): B_shard's rows are the rank's q, k and v rows of B.
  row-parallel W (columns sharded: out, down, o_proj)           A sharded by columns like W; B whole.
      y_partial = W_shard x_shard + scaling * B (A_shard x_shard): the LoRA term joins the partial
      sum before the reduction. B's gradient sums over the ranks' partial A x: rule "sum".
  whole W on S tokens (SP sub-blocks)                           A, B whole, rule "sum".
  whole W on R activations (serial, the pooler)                 A, B whole, rule "replicated".

Initial values as peft's: A ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming-uniform, a = sqrt(5)), B = 0.
"""
from __future__ import annotations

import math
import re
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from galaxy.layers.linear import OutputProjection
from galaxy.layers.sharding import keep_slice, shard_offset
from galaxy.parallel.plan import SUM, ParamRule
from galaxy.peft.lora_product import lora_product
from galaxy.peft.seeding import named_generator



class LoraLinear(nn.Linear):
    """Takes over a projection's weight and bias (the same Parameter objects, frozen) and adds
    the low-rank update. An OutputProjection's bias stays deferred to CON."""

    def __init__(self, base: nn.Linear, r: int, scaling: float, dropout: float,
                 full_in: int, full_out: int, gen: torch.Generator):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.defers_bias = isinstance(base, OutputProjection)
        self.r, self.scaling = r, scaling
        device = base.weight.device
        self.lora_A = nn.Linear(full_in, r, bias=False, device=device)
        self.lora_B = nn.Linear(r, full_out, bias=False, device=device)
        with torch.no_grad():
            bound = 1 / math.sqrt(full_in)
            self.lora_A.weight.copy_(torch.rand(r, full_in, generator=gen) * 2 * bound - bound)
            self.lora_B.weight.zero_()
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.rng_scope = nullcontext   # sharded input: the rank's own dropout stream
        self.folded = False            # the update is in the weight already (fold_into_weights)

    def shard_like(self, rule: ParamRule, rank: int) -> tuple[ParamRule, ParamRule]:
        """Slice A or B like the base weight's rule; returns the rules of (lora_A, lora_B)."""
        if rule.kind != "sharded":
            return rule, rule
        start, length = shard_offset(rule.sizes, rank), rule.sizes[rank]
        if rule.dim == 0:                   # column-parallel: B's rows (of each block of a fused W)
            keep_slice(self.lora_B, "weight", 0, start, length, rule.parts)
            return SUM, rule
        keep_slice(self.lora_A, "weight", 1, start, length, rule.parts)   # row-parallel: A's columns
        return rule, SUM

    def forward(self, x):
        bias = None if self.defers_bias else self.bias
        if self.folded:
            return F.linear(x, self.weight, bias)
        dropping = self.training and isinstance(self.lora_dropout, nn.Dropout)
        with self.rng_scope() if dropping else nullcontext():
            x_lora = self.lora_dropout(x) if dropping else None
        if torch.is_autocast_enabled(x.device.type):
            # autocast casts inside modules, not inside an autograd function: the modules' way
            y = F.linear(x, self.weight, bias)
            return y + self.lora_B(self.lora_A(x if x_lora is None else x_lora)) * self.scaling
        # one function: the update summed into y inside its GEMM (galaxy.peft.lora_product)
        return lora_product(x, x_lora, self.weight, bias, self.lora_A.weight, self.lora_B.weight, self.scaling)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, r={self.r}, scaling={self.scaling:g}"


def matches(target_modules, hf_module: str) -> bool:
    """peft's rule: a list names module-name suffixes, a string is a regular expression that
    must match the whole module name."""
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, hf_module) is not None
    return any(hf_module == t or hf_module.endswith("." + t) for t in target_modules)


def find_targets(model: nn.Module, target_modules, to_hf, required: bool = True) -> dict[str, str]:
    """{galaxy module name: Hugging Face module name} of the projections LoRA adapts.

    required False: finding none is no error (a pipeline stage whose layers hold none of the
    targets trains nothing; galaxy.preflight checks the targets on the whole model first).

    The model's output heads (model.output_heads) are refused: a classifier trains in full
    (peft's modules_to_save), and an LM head is applied through its weight (tied to the
    embeddings, sharded loss), not as a module LoRA could wrap."""
    found, projections = {}, set()
    for name, module in model.named_modules():
        if type(module) not in (nn.Linear, OutputProjection):
            continue
        hf = to_hf(f"{name}.weight").removesuffix(".weight")
        if name not in model.output_heads:
            projections.add(hf.rsplit(".", 1)[-1])
        if not matches(target_modules, hf):
            continue
        if name in model.output_heads:
            raise ValueError(f"lora_target_modules {target_modules!r} selects the output head {hf!r}, "
                             "which LoRA does not adapt (a classifier trains in full); leave it out")
        found[name] = hf
    if not found and required:
        raise ValueError(f"lora_target_modules {target_modules!r} match no projection of the model "
                         f"(it has {', '.join(sorted(projections))}); give module names as in the "
                         "Hugging Face model")
    return found


def add_lora(model: nn.Module, name: str, r: int, alpha: float, dropout: float, seed: int,
             rslora: bool = False) -> dict[str, ParamRule]:
    """Replace projection `name` with a LoraLinear; returns the rules of its new parameters."""
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    base = getattr(parent, attr)
    rule = model.attached.rules[f"{name}.weight"]
    full_out, full_in = rule.full_shape(base.weight.shape)
    scaling = alpha / math.sqrt(r) if rslora else alpha / r
    lora = LoraLinear(base, r, scaling, dropout, full_in, full_out, named_generator(seed, name))
    rule_a, rule_b = lora.shard_like(rule, model.attached.group.rank)
    # Dropout on a sharded input (row-parallel: the rank's features; SP: its tokens) draws from
    # the rank's own stream; on a replicated input every rank draws the same mask.
    sharded_input = rule.kind == "sum" or (rule.kind == "sharded" and rule.dim == 1)
    if sharded_input and model.attached.sharded_rng is not None:
        lora.rng_scope = model.attached.sharded_rng.fork
    setattr(parent, attr, lora)
    return {f"{name}.lora_A.weight": rule_a, f"{name}.lora_B.weight": rule_b}


def lora_modules(model: nn.Module) -> dict[str, LoraLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLinear)}


def merge_into(full: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """Full (gathered) tensors by galaxy name -> the same with every update folded into its
    weight (W + scaling * B A) and the lora_A / lora_B tensors dropped."""
    out = dict(full)
    for name, m in lora_modules(model).items():
        a, b = out.pop(f"{name}.lora_A.weight"), out.pop(f"{name}.lora_B.weight")
        w = out[f"{name}.weight"]
        out[f"{name}.weight"] = (w.double() + m.scaling * (b.double() @ a.double())).to(w.dtype)
    return out


@torch.no_grad()
def fold_into_weights(model: nn.Module) -> None:
    """Add every LoRA update into its base weight in place, on each rank's own shard, and stop
    computing it (inference: one matrix product per projection again). The shards multiply
    exactly: a column-parallel weight's rows are B's rows times the whole A, a row-parallel one's
    columns the whole B times A's columns (the table above). The model no longer trains LoRA."""
    for m in lora_modules(model).values():
        if not m.folded:
            m.weight += m.scaling * (m.lora_B.weight @ m.lora_A.weight)
            m.folded = True
