"""What the training engine accepts, asked of galaxy.config in one place.

The planner searches and writes only what the engine can run. Sharded data parallelism
(dp_sharding: "none" | "full" | "no_reshard", FSDP2 on the dp axis) is modelled in the cost model
(galaxy.planner.cost) but searched and written only once galaxy.config has the key, and then for
meshes without a pipeline (pp_deg 1) only, until the engine says it shards pipeline stages too.
"""
from __future__ import annotations

import dataclasses

from galaxy.config import GalaxyConfig

DP_SHARDING = ("none", "full", "no_reshard")


def engine_has_dp_sharding() -> bool:
    """True when galaxy.config accepts dp_sharding (a field of GalaxyConfig)."""
    return "dp_sharding" in {f.name for f in dataclasses.fields(GalaxyConfig)}


def dp_sharding_choices() -> tuple[str, ...]:
    """The dp_sharding values the search may choose: all of them once the engine has the key."""
    return DP_SHARDING if engine_has_dp_sharding() else ("none",)
