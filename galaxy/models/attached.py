"""The one owner of what is attached to a built model after it is defined.

A family's model (galaxy.models.family.GalaxyModel) is plain PyTorch. Three layers above it
attach state to it: a plan (galaxy.parallel.plan.apply_plan), a pipeline stage
(galaxy.pipeline.stage.keep_stage) and a PEFT method (galaxy.peft.apply_peft). All of it lives
in `model.attached`, one object with one API, instead of attributes scattered over the model
and read back through getattr.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StageInfo:
    """Which part of the model a pipeline stage holds."""
    layers: range        # global indices of its layers
    first: bool          # holds the embeddings
    last: bool           # holds the head
    # The whole model's layers of each stack ({layer.sequence: range}; one stack but for
    # encoder-decoders), so every stage knows every stack's extent.
    stacks: dict = field(default_factory=dict)
    # The first layer of the first stage that holds a trainable parameter (set by the pipeline
    # runner; 0: the first stage trains). A boundary at or before it carries no gradient back:
    # nothing below it trains (LoRA targets in later stages' layers only).
    grad_from: int = 0

    @property
    def model_layers(self) -> int:
        """How many layers the whole model has."""
        return max((r.stop for r in self.stacks.values()), default=self.layers.stop)


@dataclass
class Attached:
    # Set by apply_plan.
    plan: object = None                  # galaxy.plan.Plan
    group: object = None                 # galaxy.distributed.group.GalaxyGroup
    rules: dict = field(default_factory=dict)   # param name -> ParamRule (gradient rule, sharding)
    sharded_rng: object = None           # galaxy.layers.rng.ShardedRNG when the group is split
    # Set by keep_stage; None: the model is whole.
    stage: StageInfo | None = None
    # {last-stage copy: first-stage original} of weights tied across the pipeline's ends (the
    # same on every stage; empty when the ends are one stage).
    tied_across_stages: dict = field(default_factory=dict)
    # Parameters this stage holds that another stage holds too and writes (a stack module whose
    # stack spans several stages: the stage with the stack's first layer writes it).
    stage_copies: frozenset = frozenset()
    # Set by apply_peft (galaxy.peft.apply.PeftState); None before it runs.
    peft: object = None

    @property
    def is_first_stage(self) -> bool:
        return self.stage is None or self.stage.first

    @property
    def is_last_stage(self) -> bool:
        return self.stage is None or self.stage.last

    def add_rules(self, rules: dict, param_names) -> None:
        """Register the rules of parameters added after the plan (e.g. by galaxy.peft);
        param_names: every parameter name the model has now."""
        names = set(param_names)
        unknown = [n for n in rules if n not in names]
        if unknown:
            raise KeyError(f"no parameter {unknown[0]!r} in the model")
        self.rules.update(rules)


def written_names(model, names=None) -> set[str]:
    """The parameters (all, or those in `names`) that this rank's part contributes to a written
    state: every one but a last-stage copy of a tied weight (the first stage writes the original)
    and a stack module another stage writes (galaxy.pipeline.stage.keep_stage)."""
    copies = model.attached.tied_across_stages.keys() | model.attached.stage_copies
    return {n for n, _ in model.named_parameters() if n not in copies and (names is None or n in names)}
