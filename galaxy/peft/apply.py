"""apply_peft: turn a built (and planned) model into a parameter-efficient fine-tuning one.

    model = build_model(...)                       # full weights, plan applied
    trainable = apply_peft(model, PeftOptions.from_config(cfg), seed=cfg.seed)
    optimizer = make_optimizer(cfg, trainable.values())
    sync = GradientSync(model, group.pg)           # after apply_peft: it sees the new rules

Methods (exactly one): full (nothing changes), lora (galaxy.peft.lora), adapter
(galaxy.peft.adapter), side and side_only (galaxy.peft.side). Every method except full freezes
the backbone (requires_grad False: no gradient, no optimizer state) and trains its own new
parameters plus the task head peft saves in full for the task (modules_to_save: BERT's
classifier; nothing for a causal LM). New parameters are drawn identically on every rank from
the seed and the parameter's name, then sliced to the rank's share, and get gradient rules
(model.attached.rules) from the layout they run in, so GradientSync, gather_full, clipping and
checkpoints handle them like any other parameter.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from galaxy.config import PEFT_FLAGS, GalaxyConfig, peft_method
from galaxy.models.registry import family_of_model
from galaxy.parallel.plan import replicated_rule
from galaxy.peft.adapter import add_adapters
from galaxy.peft.lora import add_lora, find_targets
from galaxy.peft.peft_format import LoraSpec, peft_key, read_lora_dir
from galaxy.peft.side import add_side, describe_side
from galaxy.models.attached import written_names

METHODS = tuple(PEFT_FLAGS.values())
_DEFAULT = GalaxyConfig     # the config's defaults are the one place PEFT's defaults are written


@dataclass(frozen=True)
class PeftOptions:
    method: str = "full"                  # one of METHODS
    lora_dim: int = _DEFAULT.lora_dim     # r
    lora_alpha: float = _DEFAULT.lora_alpha   # scaling = alpha / r
    lora_dropout: float = _DEFAULT.lora_dropout
    lora_target_modules: tuple[str, ...] | str | None = None   # HF module names; None: the family's default
    lora_path: str | None = None          # a peft adapter directory to start from
    adapter_reduction_dim: int = _DEFAULT.adapter_reduction_dim   # the adapters' bottleneck width
    non_linearity: str = _DEFAULT.non_linearity   # the adapters' activation (transformers' ACT2FN name)
    side_reduction_factor: int = _DEFAULT.side_reduction_factor   # side width = hidden / this

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"PEFT method {self.method!r} is unknown; use one of {METHODS}")
        if isinstance(self.lora_target_modules, list):
            object.__setattr__(self, "lora_target_modules", tuple(self.lora_target_modules))

    @staticmethod
    def from_config(cfg) -> "PeftOptions":
        """From an object with the config keys (full_model, use_lora, use_adapter, use_side,
        use_side_only, lora_dim, ...; missing or None ones take the defaults). The flags select
        the method by galaxy.config.peft_method's rule (a ConfigError when two are true)."""
        method = peft_method(cfg)
        names = [f.name for f in PeftOptions.__dataclass_fields__.values() if f.name != "method"]
        return PeftOptions(method, **{n: getattr(cfg, n) for n in names
                                      if getattr(cfg, n, None) is not None})


@dataclass
class PeftState:
    """What apply_peft did (model.attached.peft): the options it ran with (lora_path's r, alpha and
    targets replacing the config's), the LoRA shape, the head trained in full."""
    options: PeftOptions
    lora: LoraSpec | None = None
    head: tuple[str, ...] = ()
    description: str = ""
    trainable: list[str] = field(default_factory=list)


def apply_peft(model: nn.Module, options: PeftOptions, seed: int = 0,
               state: dict[str, torch.Tensor] | None = None) -> dict[str, nn.Parameter]:
    """Modify the model in place; returns its trainable parameters by name.

    Call it after build_model (and, for a pipeline stage, after keep_stage), before the
    optimizer, GradientSync and any DDP wrapper are made. Every rank of the group must call it
    with the same arguments. state: full tensors by Hugging Face name (a checkpoint's model/
    folder, read_hf_state_dict) that the new parameters resume from.
    """
    family, at = family_of_model(model), model.attached
    head = tuple(m for m in model.modules_to_save if hasattr(model, m))
    if options.method == "full":
        at.peft = PeftState(options, description="full fine-tuning")
        at.peft.trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        return {n: p for n, p in model.named_parameters() if p.requires_grad}
    for p in model.parameters():
        p.requires_grad_(False)
    con_rule = replicated_rule(at.plan.con_layout, at.group)
    to_hf = family.hf_names(model.config)
    peft = PeftState(options, head=head)
    loaded: dict[str, torch.Tensor] = {}
    if options.method == "lora":
        spec = LoraSpec(options.lora_dim, options.lora_alpha,
                        options.lora_target_modules or family.lora_targets, options.lora_dropout)
        if options.lora_path:
            from_dir, tensors = read_lora_dir(options.lora_path, family.lora_fan_in_fan_out)
            spec = replace(from_dir, dropout=options.lora_dropout)   # its r, alpha, targets win
            peft.options = replace(options, lora_dim=spec.r, lora_alpha=spec.alpha,
                                   lora_target_modules=spec.target_modules)
        # A pipeline stage may hold none of the targets (they sit in other stages' layers): it
        # then trains nothing (galaxy.pipeline.runner); the whole model must hold one (preflight).
        targets = find_targets(model, spec.target_modules, to_hf, required=at.stage is None)
        rules = {}
        for name in targets:
            rules.update(add_lora(model, name, spec.r, spec.alpha, spec.dropout, seed, spec.rslora))
        if options.lora_path:
            loaded = _from_peft_dir(model, tensors, options.lora_path, family, list(rules), head)
        peft.lora, peft.description = spec, _describe_lora(spec, targets)
    elif options.method == "adapter":
        rules = add_adapters(model, options.adapter_reduction_dim, options.non_linearity, seed, con_rule)
        peft.description = (f"bottleneck adapters ({options.adapter_reduction_dim}, "
                            f"{options.non_linearity}) after every attention and MLP output")
    else:
        rules = add_side(model, options.side_reduction_factor, options.method == "side_only", seed, con_rule)
        peft.description = describe_side(model)
    at.add_rules(rules, (n for n, _ in model.named_parameters()))
    train = [*rules, *_head_params(model, head)]          # the new parameters and the task head
    params = dict(model.named_parameters())
    for name in train:
        params[name].requires_grad_(True)
    if state is not None:
        loaded.update({n: family.from_hf(to_hf(n), state[to_hf(n)]) for n in train if to_hf(n) in state})
    load_full(model, loaded)
    peft.trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    at.peft = peft
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def _head_params(model, head) -> list[str]:
    return [n for n, _ in model.named_parameters() if n.split(".")[0] in head]


def _short(hf_names) -> list[str]:
    return sorted({n.rsplit(".", 1)[-1] for n in hf_names})


def _describe_lora(spec: LoraSpec, targets: dict[str, str]) -> str:
    """The summary's words for LoRA. A pipeline stage holding none of the targets names them (what
    they select is true of the whole model)."""
    shown = spec.target_modules if isinstance(spec.target_modules, str) else ", ".join(spec.target_modules)
    where = f"{len(targets)} projections ({', '.join(_short(targets.values()))})" if targets else shown
    return f"LoRA r={spec.r} alpha={spec.alpha:g} dropout={spec.dropout:g} on {where}"


def _from_peft_dir(model, tensors: dict, path: str, family, lora_names: list[str], head) -> dict:
    """The directory's tensors by galaxy name, in galaxy's layout; every LoRA tensor the model
    needs must be there. (A pipeline stage takes its own layers' tensors and leaves the others.)"""
    to_hf = family.hf_names(model.config)
    keys = {peft_key(to_hf(n)): n for n in lora_names + _head_params(model, head)}
    unknown = [] if model.attached.stage is not None else sorted(set(tensors) - set(keys))
    missing = sorted(peft_key(to_hf(n)) for n in lora_names if peft_key(to_hf(n)) not in tensors)
    if unknown or missing:
        what = f"has {unknown[0]!r}, which this model has no place for" if unknown else f"lacks {missing[0]!r}"
        raise ValueError(f"lora_path {path!r} {what}; was it trained on another model?")
    return {keys[k]: family.from_hf(to_hf(keys[k]), t) for k, t in tensors.items() if k in keys}


@torch.no_grad()
def load_full(model: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Copy full (unsharded) tensors, by galaxy name, into this rank's shares."""
    params, rank = dict(model.named_parameters()), model.attached.group.rank
    for name, tensor in full.items():
        p, rule = params[name], model.attached.rules[name]
        if tuple(tensor.shape) != rule.full_shape(p.shape):
            raise ValueError(f"{name}: the saved tensor has shape {tuple(tensor.shape)}, the model "
                             f"needs {rule.full_shape(p.shape)}")
        tensor = rule.local(tensor, rank)
        p.copy_(tensor)


def parameter_counts(model: nn.Module, stages_pg=None) -> tuple[int, int]:
    """(trainable, total) parameters of the full model that this rank's part belongs to
    (sharded parameters count at full size). A pipeline stage counts its own parameters; with
    stages_pg (the mesh's pp group) the stages' counts are summed, a collective over it."""
    trainable = total = 0
    counted = written_names(model)      # a tied weight's pipeline copy counts on the first stage
    for name, p in model.named_parameters():
        if name not in counted:
            continue
        n = math.prod(model.attached.rules[name].full_shape(p.shape))
        total += n
        trainable += n if p.requires_grad else 0
    if stages_pg is not None:
        counts = torch.tensor([trainable, total], dtype=torch.int64, device=next(model.parameters()).device)
        torch.distributed.all_reduce(counts, group=stages_pg)
        trainable, total = counts.tolist()
    return trainable, total


def peft_summary(model: nn.Module, counts: tuple[int, int] | None = None) -> str:
    """One line: the method and trainable / total parameters (counts: parameter_counts' result,
    e.g. summed over pipeline stages; default: this model's own)."""
    trainable, total = counts or parameter_counts(model)
    peft = model.attached.peft
    what = peft.description if peft else "full fine-tuning"
    # The task head trains in full; on a pipeline it lives on the last stage only.
    head = model.modules_to_save
    head = f" + {', '.join(head)}" if peft and head and peft.options.method != "full" else ""
    return f"{what}{head}: {trainable:,} of {total:,} parameters train ({100 * trainable / max(total, 1):.2f}%)"
