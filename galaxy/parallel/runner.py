"""What every parallel runner offers the trainer, whatever the mesh.

A runner owns this rank's part of the model (`model`: the whole Galaxy-sharded model, or one
pipeline stage of it, with the full model's parameter names and gradient rules) and runs
`step(batch)`: forward and backward of one global batch (this replica's rows), gradients fully
synchronised (Galaxy "sum" rule, data-parallel average), returning the global-batch mean loss on
every rank. The trainer then clips, sets the learning rate and steps its optimizer over
`runner.parameters()`.

    runner = build_runner(...)                  # galaxy.parallel.build_runner
    loss = runner.step(batch)
    norm = runner.clip_grad_norm_(max_norm)     # optional
    optimizer.step(); optimizer.zero_grad()
    state = runner.full_state()                 # full model, Galaxy names, on every rank
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn

from galaxy.distributed import waiting
from galaxy.models.attached import written_names
from galaxy.parallel.clip import clip_grad_norm_, global_grad_norm
from galaxy.parallel.full_state import gather_full


class Runner:
    def __init__(self, model: nn.Module, mesh, autocast=nullcontext):
        self.model, self.mesh, self.autocast = model, mesh, autocast

    def step(self, batch: dict) -> torch.Tensor:
        raise NotImplementedError

    # --- the local parameters -------------------------------------------------------------

    def parameters(self):
        return self.model.parameters()

    def named_parameters(self):
        return self.model.named_parameters()

    @property
    def training(self) -> bool:
        return self.model.training

    def train(self, mode: bool = True) -> "Runner":
        self.model.train(mode)
        return self

    def eval(self) -> "Runner":
        return self.train(False)

    # --- whole-model views (collective over every rank) ------------------------------------

    @torch.no_grad()
    def full_state(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """Every parameter (or gradient) of the full model at full shape, by Galaxy name.

        Stages: all_gather_object over the pp group of CPU copies (every rank gets everything; for
        tests and small models). A weight tied across the pipeline's ends counts once, under the
        first stage's name, as in the full model (galaxy.pipeline.stage_state.written_names).
        """
        state = gather_full(self.model, grads=grads, names=written_names(self.model))
        pp_pg = self.mesh.pp_pg
        if pp_pg is None:
            return state
        parts = [None] * self.mesh.pp_size
        dist.all_gather_object(parts, {k: v.cpu() for k, v in state.items()}, group=pp_pg)
        device = next(self.model.parameters()).device
        return {k: v.to(device) for part in parts for k, v in part.items()}

    @torch.no_grad()
    def grad_norm(self) -> torch.Tensor:
        """L2 norm of the full model's gradient (after step), the same on every rank."""
        sq = global_grad_norm(self.model).square()
        if self.mesh.pp_pg is not None:
            waiting.all_reduce(sq, group=self.mesh.pp_pg)
        return sq.sqrt()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale all gradients by min(1, max_norm / (norm + 1e-6)); returns the norm before."""
        return clip_grad_norm_(self.model, max_norm, norm=self.grad_norm())
