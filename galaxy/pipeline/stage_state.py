"""Model state across pipeline stages: who writes it, who owns which name when it is read back.

A pipeline stage holds part of the full model under the full model's parameter names
(galaxy.pipeline.stage.keep_stage), so a stage's gathered state is a piece of exactly the dict a
pp_deg 1 run would write, and the pieces of all stages are disjoint. Saving and exporting:

  1. replica 0 of every stage gathers its Galaxy shards to full shape (galaxy.parallel.full_state;
     other data-parallel replicas hold the same values and skip the work entirely, unless the
     replicas shard the parameters (dp_sharding): then every replica takes part in the dp gather);
  2. the stage's Galaxy rank 0 sends its piece, as CPU tensors, to the writer (global rank 0, the
     stage-0 end of its pp group) with one gather_object over the pp group. Only that one pp group
     (dp 0, Galaxy rank 0) communicates: every other rank already returned None.

A weight tied across the pipeline's ends (tie_word_embeddings; galaxy.pipeline.stage.keep_stage)
is two parameters under PP, the first stage's original and the last stage's copy, kept equal.
Only the original is written (`written_names`), as pp_deg 1 writes the one tied weight; reading
back, the copy takes what was saved under the original's name (`tied_sources`).

Reading back (resume under any layout): a checkpoint holds every stage's names; a stage takes
those it owns (`stage_owns`) and leaves the rest to the other stages. `agree_on_load` makes the
stages fail together (one stage's error is raised on every stage, instead of the others waiting in
the next collective) and refuses names that no stage took.
"""
from __future__ import annotations

import re

import torch.distributed as dist
from torch import nn

from galaxy.parallel.dtensors import is_dp_sharded

_LAYER = re.compile(r"^layers\.(\d+)\.")


def in_writer_replica(mesh, model=None) -> bool:
    """Whether this rank takes part in gathering state for the writer: data-parallel replica 0,
    or every replica when `model`'s parameters are sharded over them (dp_sharding).

    mesh None (a caller without a mesh: one Galaxy group) takes part."""
    return mesh is None or mesh.dp_rank == 0 or (model is not None and is_dp_sharded(model))


def stages_to_writer(mesh, part: dict | None) -> dict | None:
    """This stage's piece (the same on every Galaxy rank of replica 0) -> every stage's, merged,
    on the writer (global rank 0); None on every other rank.

    mesh None, or a single stage: `part` itself is returned (on every rank that passed it).
    Collective over the pp group of (dp 0, Galaxy rank 0) only; `part` must hold CPU tensors.
    """
    if mesh is None or mesh.pp_pg is None:
        return part
    if mesh.dp_rank != 0 or mesh.galaxy.rank != 0:
        return None
    writer = dist.get_global_rank(mesh.pp_pg, 0)
    parts = [None] * mesh.pp_size if dist.get_rank() == writer else None
    dist.gather_object(part, parts, dst=writer, group=mesh.pp_pg)
    if parts is None:
        return None
    merged: dict = {}
    for stage, piece in enumerate(parts):
        clash = merged.keys() & piece.keys()
        if clash:       # stages hold disjoint names (a tied copy is never written): a bug
            raise RuntimeError(f"pipeline stage {stage} holds {sorted(clash)[0]!r}, which an "
                               "earlier stage holds too")
        merged.update(piece)
    return merged


def tied_sources(model) -> dict[str, str]:
    """{original name: this stage's copy} for the tied weights this stage holds as a copy."""
    params = dict(model.named_parameters())
    return {original: copy for copy, original in model.attached.tied_across_stages.items()
            if copy in params}


def stage_owns(model, name: str) -> bool:
    """Whether full-model parameter name `name` lives on this rank's part of the model.

    Not a pipeline stage (no model.attached.stage): every name. On a stage: "layers.{i}...." when
    layer i is one of the stage's or is no layer of the model at all (no
    stage owns it: the caller's "not a parameter" error must fire); any other name when its
    top-level module is present on this stage (embeddings and side_in on the first stage, the
    head and side_out on the last, a module every stage has). A name this predicate leaves out
    belongs to another stage.
    """
    stage = model.attached.stage
    if stage is None or name in tied_sources(model):
        return True
    m = _LAYER.match(name)
    if m is not None:
        i = int(m.group(1))
        return i in stage.layers or not 0 <= i < stage.model_layers
    # A module, not just an attribute: models keep e.g. side_out = None where none is attached.
    return isinstance(getattr(model, name.split(".", 1)[0], None), nn.Module)


def agree_on_load(mesh, error: str | None, left: set[str], what: str) -> None:
    """After every stage tried to load its part: raise the same ValueError on every stage when
    one of them failed (`error`, its message) or when a name was left by every stage (`left`:
    the names a stage did not own). Collective over the pp group; no-op without one."""
    if mesh is None or mesh.pp_pg is None:
        if error is not None:
            raise ValueError(error)
        return
    parts = [None] * mesh.pp_size
    dist.all_gather_object(parts, (error, sorted(left)), group=mesh.pp_pg)
    for stage, (message, _) in enumerate(parts):
        if message is not None:
            raise ValueError(message if stage == mesh.pp_rank else f"pipeline stage {stage}: {message}")
    nobody = set.intersection(*(set(names) for _, names in parts))
    if nobody:
        raise ValueError(f"checkpoint has {what} for parameters the model lacks: {sorted(nobody)[:3]}")
