"""The fine-tuning method a plan is costed for: the base config's full_model / use_lora /
use_adapter / use_side / use_side_only, as galaxy.peft runs it.

What each method does to the backbone decides what the cost model counts for it:

    method      backbone    per layer beside the backbone        backward through the backbone
    full        trained     -                                    input and weight gradients
    lora        frozen      rank-r updates in the targeted       input gradients only
                            projections (their shards)
    adapter     frozen      a bottleneck in each CON             input gradients only
    side        forward     a side block (ladder, gate, block)   none: the backbone runs under
                            on the CON layout                    no_grad and saves nothing
    side_only   absent      a side block                         none: its layers never run

A frozen weight has no gradient, no optimizer state and no gradient synchronisation (DDP, FSDP
and GradientSync move only parameters that require grad); it is still held (FSDP shards it like
any other and gathers it for forward, and for backward where the input gradient needs it).

The signature names what a method's cost depends on (not LoRA's alpha: a scale costs nothing); a
profile measured for one signature times only that one.
"""
from __future__ import annotations

from dataclasses import replace

from galaxy.config import peft_method
from galaxy.peft import PeftOptions
from galaxy.peft.peft_format import read_lora_dir

BACKBONE = {"full": "trained", "lora": "frozen", "adapter": "frozen", "side": "forward", "side_only": "absent"}


class BackboneRole:
    """What the costed method does with the backbone, for a cost model whose `backbone` holds a
    BACKBONE value."""
    backbone: str

    @property
    def trains_backbone(self) -> bool:
        return self.backbone == "trained"

    @property
    def backward_through_backbone(self) -> bool:
        """Whether backward runs through the backbone's layers (and so recomputation helps)."""
        return self.backbone in ("trained", "frozen")


def costed_options(options: PeftOptions, family) -> PeftOptions:
    """The options as apply_peft resolves them, without a lora_path to read weights from (the
    profiles measure a one-layer model, which has no place for a whole adapter's tensors): its
    rank, alpha and targets win over the config's; the family's targets stand in for none."""
    if options.method != "lora":
        return options
    r, alpha, targets = options.lora_dim, options.lora_alpha, options.lora_target_modules or family.lora_targets
    if options.lora_path:
        spec = read_lora_dir(options.lora_path, family.lora_fan_in_fan_out)[0]
        r, alpha, targets = spec.r, spec.alpha, spec.target_modules
    return replace(options, lora_dim=r, lora_alpha=alpha, lora_target_modules=targets, lora_path=None)


def method_signature(options: PeftOptions, family) -> dict:
    """{"method", and the options its cost depends on} (costed_options')."""
    options = costed_options(options, family)
    method = options.method
    if method == "lora":
        targets = options.lora_target_modules
        targets = targets if isinstance(targets, str) else sorted(targets)
        return {"method": method, "lora_dim": options.lora_dim, "lora_target_modules": targets,
                "lora_dropout": options.lora_dropout > 0}
    if method == "adapter":
        return {"method": method, "adapter_reduction_dim": options.adapter_reduction_dim,
                "non_linearity": options.non_linearity}
    if method in ("side", "side_only"):
        return {"method": method, "side_reduction_factor": options.side_reduction_factor}
    return {"method": "full"}


def config_signature(cfg, family) -> dict:
    """The signature of the method cfg asks for (ConfigError for two method flags)."""
    peft_method(cfg)
    return method_signature(PeftOptions.from_config(cfg), family)


def describe(signature: dict) -> str:
    """The method in a few words, for notes and errors."""
    method = signature["method"]
    if method == "lora":
        targets = signature["lora_target_modules"]
        names = targets if isinstance(targets, str) else ", ".join(targets)
        return f"LoRA r {signature['lora_dim']} on {names}"
    if method == "adapter":
        return f"adapters {signature['adapter_reduction_dim']} wide ({signature['non_linearity']})"
    if method in ("side", "side_only"):
        name = "side-tuning" if method == "side" else "side-only"
        return f"{name}, side width hidden / {signature['side_reduction_factor']}"
    return "full fine-tuning"
