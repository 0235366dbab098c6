"""Random-number state for checkpoints, and the seeding rule it restores.

Two kinds of stream feed dropout (galaxy/layers/rng.py):
  replicated  torch's default generator (CPU, and the device's on CUDA). Every rank of one
              pipeline stage (its Galaxy group and its data-parallel replicas) seeds it alike and
              advances it alike, so the stage's rank in replica 0, Galaxy rank 0 stands for all
              of them. Stages differ: stage p runs other layers, so sharing a seed would make its
              masks repeat stage 0's (stage 1's first layer would drop exactly what stage 0's
              embeddings dropped). After the model and runner are built (building draws nothing
              from these streams that matters: weights come from the checkpoint or from
              generators of their own, galaxy.peft.seeding) each stage seeds it with
              stage_seed(seed, p) = seed + 100 p (Megatron's offset; stage 0, and so every
              pp_deg 1 run, keeps the run's seed).
  sharded     the ShardedRNG of each rank (TP heads, SP tokens), seeded stage_seed(seed, p) + 1 +
              Galaxy rank (galaxy.layers.rng) for the same reason. Its state belongs to one rank
              of one layout (plan, shares, world size, pipeline).

Saved: "cpu" (and "cuda") is stage 0's replicated stream, "cpu.stage{p}" ("cuda.stage{p}")
stage p's, "sharded.{global rank}" every rank's sharded stream. A pp_deg 1 checkpoint holds
"cpu" only, as it always did.

Restored:
  replicated  stage p's saved state on every rank of stage p when the stages run the same layers
              as when saved (the plan's stages giving the same layer ranges;
              the plan, Galaxy shares and dp_deg may differ: every rank of a stage still starts
              from the same state, the lockstep rule holds). When the layer ranges changed, stage
              p's old state means nothing for the new stage p: every rank of stage p reseeds from
              (seed, -1 - p, step), identically, so the stage stays in lockstep and replays no
              mask from a fixed seed.
  sharded     only when the whole layout (plan, shares, world size, pipeline) and the device type
              are unchanged; otherwise every rank starts a fresh stream seeded from (seed, global
              rank, step).
In both fallbacks dropout masks differ from an uninterrupted run (they would anyway: the rows,
tokens, heads or layers each rank owns have changed); with dropout 0, as in exactness tests,
nothing differs. Python's hash of a tuple of ints is the same in every process.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from galaxy.layers.rng import ShardedRNG

STAGE_SEED_STRIDE = 100


def stage_seed(seed: int, stage: int) -> int:
    """The seed of pipeline stage `stage`'s random streams."""
    return seed + STAGE_SEED_STRIDE * stage


def replicated_key(stage: int, kind: str = "cpu") -> str:
    """rng.safetensors key of stage `stage`'s default generator (kind "cpu" or "cuda")."""
    return kind if stage == 0 else f"{kind}.stage{stage}"


def sharded_rng_of(model) -> ShardedRNG | None:
    """The ShardedRNG a plan wired into the model (None in serial training: nothing is sharded)."""
    return model.attached.sharded_rng


def seed_streams(model, seed: int, stage: int, device: torch.device) -> None:
    """Start this rank's streams for training stage `stage` (after the model is built)."""
    torch.manual_seed(stage_seed(seed, stage))          # CPU and every CUDA device
    sharded = sharded_rng_of(model)
    if sharded is not None:
        sharded.state = ShardedRNG(stage_seed(seed, stage), model.attached.group.rank, device).state


def capture_rng(model, device: torch.device, mesh=None) -> dict[str, torch.Tensor] | None:
    """Collective over the default group: every rank calls it; the writer (global rank 0) gets
    {"cpu", "cuda"?, "cpu.stage{p}", "cuda.stage{p}"?, "sharded.{rank}"?: uint8 tensors} (see
    the module docstring), the other ranks None. mesh None: a single stage (pp_deg 1).

    Only what the file holds travels: each stage's replicated state from its representative
    (replica 0, Galaxy rank 0) and every rank's sharded state, to rank 0 in one gather_object.
    """
    mine: dict[str, torch.Tensor] = {}
    stage = 0 if mesh is None else mesh.pp_rank
    represents = dist.get_rank() == 0 if mesh is None else mesh.dp_rank == 0 and mesh.galaxy.rank == 0
    if represents:
        mine[replicated_key(stage)] = torch.get_rng_state()
        if device.type == "cuda":
            mine[replicated_key(stage, "cuda")] = torch.cuda.get_rng_state(device)
    sharded = sharded_rng_of(model)
    if sharded is not None:
        mine[f"sharded.{dist.get_rank()}"] = sharded.state.cpu()
    every = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, every, group_dst=0)
    if every is None:
        return None
    return {key: state for part in every for key, state in part.items()}


def restore_rng(model, device: torch.device, saved: dict[str, torch.Tensor], *,
                same_layout: bool, seed: int, step: int, stage: int = 0, same_stages: bool = True) -> None:
    """Restore (or reseed) this rank's streams; no collective.

    stage: this rank's pipeline stage; same_stages: the stages run the layer ranges they ran
    when saved; same_layout: the whole layout is unchanged (see the module docstring).
    """
    key = replicated_key(stage)
    if same_stages and key in saved:
        torch.set_rng_state(saved[key])
        cuda = replicated_key(stage, "cuda")
        if device.type == "cuda" and cuda in saved:
            torch.cuda.set_rng_state(saved[cuda], device)
    else:
        # Identical on every rank of the stage; -1 - stage never equals a rank of the fallback below.
        torch.manual_seed(hash((seed, -1 - stage, step)) & (2**63 - 1))
    sharded = sharded_rng_of(model)
    if sharded is None:
        return
    rank = dist.get_rank()
    mine = saved.get(f"sharded.{rank}")
    if same_layout and mine is not None:
        sharded.state = mine
    else:
        generator = torch.Generator(device=device)
        # A seed no uninterrupted run uses: the run's own streams are stage_seed + 1 + Galaxy rank.
        generator.manual_seed(hash((seed, rank, step)) & (2**63 - 1))
        sharded.state = generator.get_state()
