"""Training checkpoints: full, unsharded, written atomically, resumable under any plan and world.

    save_dir/
      latest                      text: the name of the newest complete checkpoint folder
      step-00000120/
        model/                    a Hugging Face folder (galaxy.runtime.export): full weights
        optimizer.safetensors     full-shape optimizer state by parameter name (optim_state.py)
        rng.safetensors           random states (rng_state.py)
        trainer_state.json        step, data position, schedule, optimizer hyperparameters, layout
        manifest.json             every file's size and SHA-256 (manifest.py), written last

Resuming verifies the manifest first: a damaged checkpoint named by path or save_dir/step-N is an
error naming the bad file; resume "latest" (or a save_dir) skips damaged checkpoints and takes
the newest one that verifies, and the Checkpoint's notes say which were skipped.

Atomicity: rank 0 writes the whole folder under a hidden temporary name, fsyncs it, renames it
to step-N, and only then replaces `latest` (itself written to a temp file and renamed). A process
killed at any point leaves `latest` naming a complete checkpoint; the half-written temporary
folder is removed by the next save. Every rank takes part in the gathers; only rank 0 writes.
Resuming reads the folder on every rank: with several machines save_dir must be shared.

Pipeline parallelism changes nothing in the folder: the stages' weights and optimizer state are
gathered to rank 0 (galaxy.pipeline.stage_state), which writes the files a pp_deg 1 run writes;
rng.safetensors adds one replicated stream per stage and trainer_state.json's layout records the
pipeline (rng_state.py). Any layout resumes from it: each stage takes its own parameters.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field

import torch
from safetensors.torch import load_file

from galaxy.models.build import CheckpointError
from galaxy.runtime.export import classifier_config, hf_state_dict, write_hf_dir
from galaxy.files import fsync_path, write_json_atomic, write_safetensors_atomic, write_text_atomic
from galaxy.train.manifest import verify, write_manifest
from galaxy.train.optim_state import gather_optimizer_state
from galaxy.train.rng_state import capture_rng

POINTER = "latest"
STATE_FILE = "trainer_state.json"
FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d+)$")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


@dataclass
class Checkpoint:
    path: str       # the step-N folder
    state: dict     # trainer_state.json
    notes: list[str] = field(default_factory=list)     # newer checkpoints skipped as damaged

    @property
    def step(self) -> int:
        return self.state["step"]

    @property
    def model_dir(self) -> str:
        return os.path.join(self.path, "model")

    def optimizer_tensors(self) -> dict[str, torch.Tensor]:
        return load_file(os.path.join(self.path, "optimizer.safetensors"))

    def rng_tensors(self) -> dict[str, torch.Tensor]:
        return load_file(os.path.join(self.path, "rng.safetensors"))


def read_checkpoint(path: str, verified: bool = False) -> Checkpoint:
    """The checkpoint in folder `path`, verified against its manifest (unless the caller did)."""
    try:
        with open(os.path.join(path, STATE_FILE), encoding="utf-8") as f:
            state = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not a complete checkpoint ({STATE_FILE}: {e})") from None
    if state.get("format") != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {state.get('format')!r}, this galaxy reads {FORMAT}")
    problem = None if verified else verify(path)
    if problem:
        raise CheckpointError(f"checkpoint {path} is damaged: {problem}; resume from another checkpoint "
                              f"(save_dir/step-N, or \"latest\" for the newest one that verifies)")
    return Checkpoint(path, state)


def _complete_steps(save_dir: str) -> list[tuple[int, str]]:
    """(step, folder) of every complete checkpoint in save_dir, oldest first."""
    found = []
    for name in os.listdir(save_dir) if os.path.isdir(save_dir) else []:
        m = _STEP_DIR.match(name)
        if m and os.path.isfile(os.path.join(save_dir, name, STATE_FILE)):
            found.append((int(m.group(1)), os.path.join(save_dir, name)))
    return sorted(found)


def latest_checkpoint(save_dir: str) -> Checkpoint | None:
    """The checkpoint `latest` names, else the newest complete one; one that fails verification
    is skipped for the next newest (the result's notes say so). None: no checkpoint at all."""
    candidates = [path for _, path in reversed(_complete_steps(save_dir))]
    try:
        with open(os.path.join(save_dir, POINTER), encoding="utf-8") as f:
            named = os.path.join(save_dir, f.read().strip())
        if named in candidates:
            candidates.remove(named)
            candidates.insert(0, named)
    except OSError:
        pass
    skipped = []
    for path in candidates:
        problem = verify(path)
        if problem:
            skipped.append(f"resume: {os.path.basename(path)} in {save_dir} is damaged ({problem}); skipped it")
            continue
        ckpt = read_checkpoint(path, verified=True)
        if skipped:
            ckpt.notes = skipped + [f"resume: using {os.path.basename(path)}, the newest checkpoint that verifies"]
        return ckpt
    if skipped:
        raise CheckpointError(f"no checkpoint in {save_dir} verifies; the newest: {skipped[0].split(': ', 1)[1]}")
    return None


def resolve_resume(resume: str | None, save_dir: str | None) -> Checkpoint | None:
    """resume: None, "latest" (in save_dir; None when there is no checkpoint yet), a checkpoint
    folder, or a save_dir (its latest). Raises CheckpointError for a folder holding neither."""
    if resume is None:
        return None
    if resume == "latest":
        return latest_checkpoint(save_dir)
    if os.path.isfile(os.path.join(resume, STATE_FILE)):
        return read_checkpoint(resume)
    found = latest_checkpoint(resume)
    if found is None:
        raise CheckpointError(f"resume {resume!r} holds no checkpoint: give a step-N folder of a "
                              f"save_dir, a save_dir, or \"latest\"")
    return found


def _remove_stale(save_dir: str) -> None:
    """Temporary files and folders of saves that were killed midway."""
    for name in os.listdir(save_dir):
        path = os.path.join(save_dir, name)
        if name.startswith(".") and (".tmp-" in name or ".old-" in name):
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.remove(path)


def _prune(save_dir: str, keep: int | None, newest: str) -> None:
    if keep is None:
        return
    for _, path in _complete_steps(save_dir)[:-keep]:
        if path != newest:
            shutil.rmtree(path, ignore_errors=True)


def save_checkpoint(save_dir: str, step: int, *, model, optimizer, trainer_state: dict,
                    base_model_path: str, class_names: list[str], tokenizer, device,
                    lead: bool, keep: int | None = None, mesh=None) -> str | None:
    """Collective: every rank calls it, rank `lead` writes. Returns the folder (lead) or None.

    mesh: the run's mesh (needed with several pipeline stages; lead must then be global rank 0).
    """
    weights = hf_state_dict(model, mesh)
    opt_tensors, opt_groups = gather_optimizer_state(model, optimizer, mesh)
    rng = capture_rng(model, device, mesh)
    if not lead:
        return None
    os.makedirs(save_dir, exist_ok=True)
    _remove_stale(save_dir)
    name = step_dir_name(step)
    final = os.path.join(save_dir, name)
    temp = os.path.join(save_dir, f".{name}.tmp-{os.getpid()}")
    os.makedirs(temp)
    write_hf_dir(os.path.join(temp, "model"), classifier_config(base_model_path, class_names),
                 weights, tokenizer)
    write_safetensors_atomic(os.path.join(temp, "optimizer.safetensors"), opt_tensors)
    write_safetensors_atomic(os.path.join(temp, "rng.safetensors"), rng)
    write_json_atomic(os.path.join(temp, STATE_FILE),
                      {"format": FORMAT, "step": step, **trainer_state, "optimizer_groups": opt_groups})
    write_manifest(temp)            # last: it lists every file above
    fsync_path(os.path.join(temp, "model"))
    fsync_path(temp)
    if os.path.exists(final):      # the same step saved by an earlier, abandoned run: replace it
        old = os.path.join(save_dir, f".{name}.old-{os.getpid()}")
        os.rename(final, old)
        os.rename(temp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(temp, final)
    fsync_path(save_dir)
    write_text_atomic(os.path.join(save_dir, POINTER), name + "\n")
    _prune(save_dir, keep, final)
    return final
