"""The checks that need the world and the model: can this config run as rank R of N processes?
And the plan it runs, every share concrete."""
from __future__ import annotations

from galaxy.config.errors import ConfigError, raise_all
from galaxy.plan import Plan, PlanError, Workload


def workload(cfg, shape: dict) -> Workload:
    """The model's sizes (galaxy.models.shape.read_model_shape) and the config's batch; an
    encoder-decoder's decoder reads target_pad_size tokens (default pad_size)."""
    return Workload.of(shape, cfg.pad_size, cfg.batch_size, target_tokens(cfg))


def target_tokens(cfg) -> int:
    """Tokens of an encoder-decoder's decoder rows: target_pad_size, else pad_size (a classifier's
    decoder reads the source: target_pad_size is refused with it)."""
    return cfg.target_pad_size or cfg.pad_size


def validate_for_world(cfg, world: int, rank: int, shape: dict) -> None:
    """Check that cfg can run as `rank` of `world` processes on a model of `shape`; raises one
    ConfigError naming every problem found."""
    if world < 1:
        raise ConfigError(f"--world must be at least 1, got {world}")
    if not 0 <= rank < world:
        raise ConfigError(f"--rank {rank} is out of range for --world {world}; use 0..{world - 1}")
    if cfg.preset == "serial" and world != 1:
        who = cfg._script or "the serial preset"
        raise ConfigError(f"--world is {world} but {who} runs on one process; use --world 1 "
                          f"or a distributed script")
    problems = cfg.plan.problems(world, workload(cfg, shape))
    for key in ("pad_size", "target_pad_size"):
        value = getattr(cfg, key)
        if value is not None and value > shape["max_position_embeddings"]:
            problems.append(f"{key} {value} exceeds the model's max_position_embeddings "
                            f"{shape['max_position_embeddings']}; lower {key}")
    raise_all(problems)


def resolved_plan(cfg, world: int, shape: dict) -> Plan:
    """cfg's plan for `world` processes on a model of `shape`, every share, stage and recomputed
    layer concrete (omitted share lists split evenly, larger shares first)."""
    try:
        return cfg.plan.resolve(world, workload(cfg, shape))
    except PlanError as e:
        raise ConfigError(*e.problems) from None
