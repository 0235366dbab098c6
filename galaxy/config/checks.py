"""The checks of a loaded config that need no world: each key's declared range, then the rules
that tie keys together. Every problem is one line naming the key and the fix."""
from __future__ import annotations

from galaxy.config.errors import ConfigError
from galaxy.config.keys import PEFT_FLAGS, GalaxyConfig
from galaxy.config.schema import declared, range_problem
from galaxy.plan import Plan


def key_problems(cfg: GalaxyConfig) -> list[str]:
    """Every out-of-range value and every pair of keys that disagree, one line each."""
    problems = []
    for f, _ in declared(type(cfg)):
        value = getattr(cfg, f.name)
        if value is not None:
            line = range_problem(f.name, value, f.metadata)
            if line:
                problems.append(line)
    try:
        peft_method(cfg)
    except ConfigError as e:
        problems += e.problems
    if cfg.init_method is not None and not cfg.init_method.startswith(("tcp://", "file://", "env://")):
        problems.append(f"init_method {cfg.init_method} must start with tcp://, file:// or env://")
    for name in ("save_interval", "keep_checkpoints"):
        if getattr(cfg, name) is not None and cfg.save_dir is None:
            problems.append(f"{name} is set but save_dir is not; add save_dir or remove {name}")
    if cfg.resume == "latest" and cfg.save_dir is None:
        problems.append('resume is "latest" but save_dir is not set; add save_dir (the folder '
                        'the checkpoints are in) or give resume a checkpoint folder')
    if cfg.task == "classification" and cfg.target_pad_size is not None:
        problems.append("target_pad_size is set but task is classification, whose decoder (BART, T5) reads the "
                        "source shifted right, pad_size tokens; remove target_pad_size")
    # The plan checks its own keys too: a line both give is said once.
    return list(dict.fromkeys(problems + plan_key_problems(cfg, cfg.batch_size)))


def peft_method(cfg) -> str:
    """The PEFT method the flags select (galaxy.peft's name for it); ConfigError unless at most
    one flag is true. None true means full fine-tuning, unless the config set full_model to
    false explicitly (it is in cfg._given): then it asked for no method at all."""
    on = [flag for flag in PEFT_FLAGS if getattr(cfg, flag, False)]
    if len(on) > 1 or (not on and "full_model" in getattr(cfg, "_given", ())):
        got = " and ".join(on) + (" are all true" if on else "full_model is false and no other is true")
        raise ConfigError(f"{got}; set exactly one of {', '.join(PEFT_FLAGS)} to true")
    return PEFT_FLAGS[on[0]] if on else "full"


def plan_key_problems(keys, rows: int | None = None) -> list[str]:
    """What is wrong with a config's plan keys before any world or model is known (keys: an
    object with the flat keys as attributes; rows: the global batch)."""
    plan = Plan.from_keys(keys)
    problems = plan.key_problems()
    accumulation = getattr(keys, "grad_accum_steps", 1)
    if plan.pp > 1 and accumulation > 1:
        problems.append("grad_accum_steps does not apply with pp_deg > 1 (the pipeline's "
                        "num_microbatches is its accumulation); remove it")
    if plan.pp == 1 and rows is not None and accumulation >= 1 and rows % accumulation:
        problems.append(f"batch_size {rows} is not divisible by grad_accum_steps "
                        f"{accumulation}; batch_size is the global batch of one optimizer "
                        f"step, split into grad_accum_steps equal micro-batches")
    return problems + batch_stream_problems(plan, rows)


def batch_stream_problems(plan: Plan, rows: int | None) -> list[str]:
    """batch_streams against the micro-batch it cuts and the modes it cannot interleave."""
    problems, streams = [], plan.batch_streams
    if streams > 1 and plan.dp_sharding != "none":
        problems.append(f"batch_streams {streams} cannot run under dp_sharding '{plan.dp_sharding}' (FSDP2 "
                        f"gathers a layer's weights once per forward, not once per stream); set batch_streams "
                        f"to 1 or dp_sharding to 'none'")
    split = 'num_microbatches' if plan.pp > 1 else 'grad_accum_steps'
    micro = max(plan.dp, 1) * max(plan.microbatches, 1)
    if streams > 1 and plan.replica_rows is not None:        # uneven replicas: the smallest one's micro-batch
        least = min(plan.replica_rows) // max(plan.microbatches, 1)
        if least < streams:
            problems.append(f"batch_streams {streams} exceeds the {least} rows of the smallest replica's "
                            f"micro-batch (dp_batch_list {list(plan.replica_rows)} / {split} {plan.microbatches}); "
                            f"use at most {least} streams or give that replica more rows")
    elif streams > 1 and rows is not None and rows % micro == 0 and rows // micro < streams:
        problems.append(f"batch_streams {streams} exceeds the {rows // micro} rows of a micro-batch (batch_size "
                        f"{rows} / dp_deg {plan.dp} / {split} "
                        f"{plan.microbatches}); use at most {rows // micro} streams or raise batch_size")
    return problems
