"""finetune_llama.py's two jobs: train (the shared trainer), or --generate a greedy continuation.

    finetune_llama.py --config_file C [--world N --rank R] --generate "PROMPT" --max_new_tokens K

loads the weights (model_path, or the checkpoint named by `resume`), does not train, and prints
the prompt and its greedy continuation (rank 0), under any Galaxy plan of the config.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from galaxy.config import ConfigError
from galaxy.models.shape import read_model_shape
from galaxy.runtime.assemble import build_model
from galaxy.runtime.generate import greedy_generate
from galaxy.runtime.runners import plan_and_mesh
from galaxy.train.checkpoint import Checkpoint, resolve_resume
from galaxy.train.trainer import Job, check_task, prepare_causal_lm, train


def add_generation_arguments(parser) -> None:
    parser.add_argument("--generate", metavar="PROMPT", help="print the greedy continuation of PROMPT; no training")
    parser.add_argument("--max_new_tokens", type=int, default=32, metavar="K",
                        help="tokens to generate with --generate (default 32)")


@dataclass
class GenerationJob:
    cfg: object
    tokenizer: object
    shape: dict
    prompt: str
    max_new_tokens: int
    resume: Checkpoint | None


def prepare_llama(cfg, args):
    if args.generate is None:
        return prepare_causal_lm(cfg)
    from transformers import AutoTokenizer
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max_new_tokens must be at least 1, got {args.max_new_tokens}")
    if cfg.plan.pp > 1:
        raise ConfigError("--generate runs Galaxy plans, not pipelines; set pp_deg to 1")
    shape = read_model_shape(cfg.model_path)
    check_task(shape["model_type"], "causal_lm")
    tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
    return GenerationJob(cfg, tokenizer, shape, args.generate, args.max_new_tokens,
                         resolve_resume(cfg.resume, cfg.save_dir))


def generate(job: GenerationJob, env) -> list[int]:
    cfg = job.cfg
    torch.manual_seed(cfg.seed)
    plan, mesh = plan_and_mesh(cfg, env.world, job.shape)
    source = job.resume.model_dir if job.resume else cfg.model_path
    model = build_model(source, plan, mesh.galaxy, seed=cfg.seed, device=env.device, task="causal_lm")
    ids = greedy_generate(model, job.tokenizer, job.prompt, job.max_new_tokens, cfg.pad_size, env.device)
    if env.rank == 0:
        print(job.prompt + job.tokenizer.decode(ids, skip_special_tokens=True), flush=True)
        print(f"generated token ids: {ids}", flush=True)
    return ids


def run_llama(job, env):
    return train(job, env) if isinstance(job, Job) else generate(job, env)
