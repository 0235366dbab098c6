"""What each entry script fixes of a config: pretrain_tp_bert.py runs the tp methods whatever the
config says, pretrain_dp_bert.py fills the world with replicas, and so on.

The method combinations themselves are galaxy.plan.PRESETS (one table); this file only says which
script runs which of them, or none (pretrain_galaxy.py runs whatever the config says).
"""
from __future__ import annotations

import dataclasses

from galaxy.config.errors import ConfigError, raise_all
from galaxy.plan import FIELD_OF_KEY, PRESETS

METHOD_KEYS = {field: key for key, field in FIELD_OF_KEY.items() if field in ("att", "mlp", "con")}
# Entry-script preset -> the galaxy.plan preset whose methods it fixes (None: fixes none). "serial"
# runs one process (galaxy.config.world checks it).
SCRIPT_METHODS = {"serial": None, "tp": "tp", "sp": "sp", "galaxy": None, "dp": None, "pp": None}
# pretrain_dp_bert.py / pretrain_pp_bert.py: every rank not claimed by the other axis is a data
# replica / a pipeline stage, unless the config gives the degree (then the rest is Galaxy groups).
FILLS = {"dp": ("dp_deg", "pp_deg"), "pp": ("pp_deg", "dp_deg")}


def apply_preset(cfg, preset: str, script: str | None = None, world: int | None = None):
    """A copy of cfg with the parallel methods that the entry script `script` runs.

    For the dp / pp presets with `world` known, an omitted dp_deg / pp_deg becomes
    world // (the other degree). A method key the JSON set explicitly to something else is an
    error rather than being silently overridden: the user asked for a method this script does
    not run.
    """
    if preset not in SCRIPT_METHODS:
        raise ConfigError(f"preset '{preset}' is unknown; valid presets: {', '.join(SCRIPT_METHODS)}")
    who = script or f"the '{preset}' preset"
    fixed = {} if SCRIPT_METHODS[preset] is None else dict(zip(("att", "mlp", "con"), PRESETS[SCRIPT_METHODS[preset]]))
    methods = {METHOD_KEYS[field]: value for field, value in fixed.items()}
    raise_all([f"{key} is '{getattr(cfg, key)}' but {who} runs {key[:3].upper()} {value}; remove the "
               f"key or use pretrain_galaxy.py"
               for key, value in methods.items() if key in cfg._given and getattr(cfg, key) != value])
    fill = {}
    if preset in FILLS and world is not None:
        key, other = FILLS[preset]
        if key not in cfg._given:
            fill[key] = max(1, world // getattr(cfg, other))
    out = dataclasses.replace(cfg, **methods, **fill, preset=preset, _script=script)
    if out.pp_deg > 1 and out.num_microbatches < out.pp_deg and "pipeline_schedule" not in cfg._given:
        # 1F1B keeps a micro-batch in flight per stage, so it needs at least pp_deg of them;
        # with fewer (Galaxy-LM's pipeline configs use 1) GPipe computes the same step.
        note = (f"num_microbatches {out.num_microbatches} < pp_deg {out.pp_deg}: pipeline_schedule "
                f"gpipe (1f1b needs at least pp_deg micro-batches)")
        out = dataclasses.replace(out, pipeline_schedule="gpipe", _notes=(*out._notes, note))
    return out
