"""generate.py: complete prompts under the config's plan, started like training (one process per
device, or torchrun), with a causal LM's or an encoder-decoder's engine as model_path holds;
finetune_llama.py, finetune_bart.py and finetune_t5.py --generate run through it too.

    python generate.py --config_file C [--world N --rank R] (--prompt TEXT | --prompts FILE)
        [--out FILE.jsonl] [--max_new_tokens K] [--temperature T --top_k K --top_p P --seed S]
        [--stop TEXT ...] [--ignore_eos] [--chat] [--num_beams K [--length_penalty L] [--early_stopping E]]

Every rank reads and tokenises the prompts before any process group starts (a bad file, a prompt
too long for the model's positions or the plan's pad_size: one line, exit 2). The data-parallel
replicas split the prompts; each generates batch_size / dp_deg of them at a time. Rank 0 writes
--out, one JSON line per prompt in input order ({"prompt", "completion", "completion_tokens",
"finish_reason"}), or prints those lines; then, on stderr, the tokens/s and every rank's KV cache.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, replace

from galaxy.config import ConfigError
from galaxy.files import write_text_atomic
from galaxy.inference.model import generation_engine, generation_task, inference_model
from galaxy.inference.prompts import Prompt, prompt_ids, read_prompts
from galaxy.inference.replicas import cache_mib_per_rank, generate_all, replica_batch
from galaxy.inference.requests import Completion, Request
from galaxy.inference.setup import (FromSetup, InferenceSetup, add_beam_arguments, add_sampling_arguments, beams_of,
                                    prepare_inference, sampling_of)
from galaxy.preflight.paths import check_writable
from galaxy.runtime.runners import plan_and_mesh


def add_generate_arguments(p) -> None:
    p.add_argument("--prompt", metavar="TEXT", help="one prompt")
    p.add_argument("--prompts", metavar="FILE", help='prompts: JSON lines {"prompt": ...} or one text per line')
    p.add_argument("--out", metavar="FILE.jsonl", help="write the completions here (default: print them)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template as a "
                                                      "user turn (training's template when it has none)")
    add_sampling_arguments(p)
    add_beam_arguments(p)


@dataclass
class GenerateJob(FromSetup):
    setup: InferenceSetup
    requests: list[Request]
    out: str | None
    echo: bool = False          # finetune_llama.py --generate's output: the text and the token ids

    @property
    def what(self) -> str:
        """--check's words for it."""
        n = len(self.requests)
        first = f"the prompt {self.requests[0].prompt!r}" if n == 1 else f"{n} prompts"
        beams = self.requests[0].beams.num_beams
        return f"generate up to {self.requests[0].max_new_tokens} tokens after {first}" + \
            (f" by beam search ({beams} beams)" if beams > 1 else "")


def prepare_generate(cfg, args) -> GenerateJob:
    if (args.prompt is None) == (args.prompts is None):
        raise ConfigError("give exactly one of --prompt TEXT and --prompts FILE")
    prompts = [Prompt(args.prompt)] if args.prompt is not None else read_prompts(args.prompts)
    if args.out is not None:
        check_writable("--out", args.out, "file")
    return GenerateJob(*requests_job(cfg, args, prompts), out=args.out)


def requests_job(cfg, args, prompts: list[Prompt]) -> tuple[InferenceSetup, list[Request]]:
    """The setup and one request per prompt, prompt i sampling with seed + i."""
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max_new_tokens must be at least 1, got {args.max_new_tokens}")
    setup = prepare_inference(cfg, args.world)
    sampling = sampling_of(args, cfg.seed)
    beams = beams_of(args, sampling)
    requests = []
    for i, prompt in enumerate(prompts):
        ids = prompt_ids(setup.tokenizer, prompt, args.chat)
        problem = setup.limits.problem(len(ids), args.max_new_tokens)
        if problem:
            where = "--prompt" if len(prompts) == 1 and args.prompts is None else f"{args.prompts}: prompt {i + 1}"
            raise ConfigError(f"{where}: {problem}")
        requests.append(Request(prompt.text, tuple(ids), args.max_new_tokens, replace(sampling, seed=sampling.seed + i),
                                tuple(args.stop), args.ignore_eos, beams))
    return setup, requests


def run_generate(job: GenerateJob, env) -> list[Completion]:
    cfg = job.cfg
    plan, mesh = plan_and_mesh(cfg, env.world, job.setup.shape)
    model = inference_model(cfg, plan, mesh, resume=job.resume, peft=job.peft, device=env.device,
                            task=generation_task(job.setup.shape))
    engine = generation_engine(model, plan, mesh, job.tokenizer, env.device)
    start = time.perf_counter()
    done = generate_all(engine, job.requests, replica_batch(cfg, plan))
    seconds = time.perf_counter() - start
    cache = cache_mib_per_rank(engine, env.launch_rank)
    if env.rank == 0:
        report(job, done, seconds, cache)
    return done


def report(job: GenerateJob, done: list[Completion], seconds: float, cache_mib: list[float]) -> None:
    if job.echo:
        for c in done:
            print(c.prompt + c.text, flush=True)
            print(f"generated token ids: {c.tokens}", flush=True)
    elif job.out is None:
        for c in done:
            print(json.dumps(c.record(), ensure_ascii=False), flush=True)
    else:
        write_text_atomic(job.out, "".join(json.dumps(c.record(), ensure_ascii=False) + "\n" for c in done))
    tokens = sum(len(c.tokens) for c in done)
    sys.stderr.write(f"generated {tokens} tokens for {len(done)} prompts in {seconds:.2f} s "
                     f"({tokens / max(seconds, 1e-9):.1f} tokens/s); KV cache per rank (MiB): "
                     f"{', '.join(f'{m:.2f}' for m in cache_mib)}" + (f"; wrote {job.out}" if job.out else "") + "\n")
