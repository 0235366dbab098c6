"""What every generating job reads and checks before any process group starts (generate.py,
finetune_llama.py / finetune_bart.py / finetune_t5.py --generate, serve.py), so that a mistake is
one line and exit status 2: the model is a causal LM or an encoder-decoder,
its tokenizer, the checkpoint `resume` names, the PEFT method (side-tuning has no cache:
refused), and the limits a prompt must respect under the plan."""
from __future__ import annotations

from dataclasses import dataclass

from galaxy.config import ConfigError, resolved_plan
from galaxy.inference.model import generation_task
from galaxy.inference.prompts import Limits
from galaxy.inference.sampling import Beams, Sampling
from galaxy.models.shape import read_model_shape
from galaxy.peft import PeftOptions
from galaxy.preflight.tokenizer import load_tokenizer
from galaxy.train.checkpoint import Checkpoint, resolve_resume
from galaxy.train.trainer import check_task


@dataclass
class InferenceSetup:
    cfg: object
    tokenizer: object
    shape: dict
    resume: Checkpoint | None
    peft: PeftOptions
    limits: Limits



class FromSetup:
    """What the launcher's checks read off a job (galaxy.preflight, galaxy.distributed.agreement),
    taken from the job's InferenceSetup: generate.py's and serve.py's jobs both hold one."""
    setup: InferenceSetup

    @property
    def cfg(self):
        return self.setup.cfg

    @property
    def tokenizer(self):
        return self.setup.tokenizer

    @property
    def resume(self):
        return self.setup.resume

    @property
    def peft(self):
        return self.setup.peft


def checked_model(cfg, task: str) -> tuple[dict, PeftOptions]:
    """(model_path's shape, the PEFT options) of a model asked to do `task`; ConfigError otherwise."""
    shape = read_model_shape(cfg.model_path)
    check_task(shape["model_type"], task)
    try:
        return shape, PeftOptions.from_config(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def prepare_inference(cfg, world: int) -> InferenceSetup:
    """A causal LM's or an encoder-decoder's (its model_path decides) generating job."""
    task = generation_task(read_model_shape(cfg.model_path))
    shape, peft = checked_model(cfg, task)
    if peft.method in ("side", "side_only"):
        raise ConfigError(f"{peft.method.replace('_', '-')}-tuning runs its side network over whole sequences "
                          "and has no KV cache; generate with use_lora, use_adapter or full weights")
    plan = resolved_plan(cfg, world, shape)
    limits = Limits(shape["max_position_embeddings"], cfg.pad_size if plan.splits_prompt() else None,
                    separate=task == "seq2seq")
    return InferenceSetup(cfg, load_tokenizer(cfg.model_path), shape, resolve_resume(cfg.resume, cfg.save_dir),
                          peft, limits)


def sampling_of(args, default_seed: int) -> Sampling:
    """The sampling flags (--temperature, --top_k, --top_p, --seed); ConfigError naming a bad one."""
    seed = default_seed if args.seed is None else args.seed
    sampling = Sampling(args.temperature, args.top_k, args.top_p, seed)
    problems = sampling.problems()
    if problems:
        raise ConfigError("--" + problems[0])
    return sampling


def beams_of(args, sampling: Sampling) -> Beams:
    """The beam-search flags (--num_beams, --length_penalty, --early_stopping); ConfigError naming
    a bad one or one that beam search does not combine with."""
    beams = Beams(args.num_beams, args.length_penalty, EARLY_STOPPING[args.early_stopping])
    problems = beams.problems()
    if problems:
        raise ConfigError("--" + problems[0])
    if beams.num_beams == 1:
        if args.length_penalty != 1.0 or args.early_stopping != "false":
            raise ConfigError("--length_penalty and --early_stopping apply to beam search only: add --num_beams K "
                              "(K > 1) or drop them")
        return beams
    if not sampling.greedy:
        raise ConfigError(f"--num_beams {beams.num_beams} searches beams without sampling (Hugging Face's "
                          "do_sample=False): drop --temperature or use --num_beams 1")
    if args.stop:
        raise ConfigError("--stop is not applied under beam search: drop it or use --num_beams 1")
    return beams


EARLY_STOPPING = {"false": False, "true": True, "never": "never"}


def add_beam_arguments(p) -> None:
    p.add_argument("--num_beams", type=int, default=1, metavar="K",
                   help="beam search with K beams per prompt, as Hugging Face's generate(num_beams=K, "
                        "do_sample=False) (default 1: greedy or sampled)")
    p.add_argument("--length_penalty", type=float, default=1.0,
                   help="beam search: a finished beam scores its log-probability / length ** this (default 1)")
    p.add_argument("--early_stopping", choices=sorted(EARLY_STOPPING), default="false",
                   help="beam search: when a prompt is done, as Hugging Face's early_stopping (default false)")


def add_sampling_arguments(p) -> None:
    p.add_argument("--max_new_tokens", type=int, default=32, metavar="K", help="tokens to generate (default 32)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 (default): greedy, the most likely token; above 0: sample at this temperature")
    p.add_argument("--top_k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--top_p", type=float, default=1.0, help="sample among the most likely tokens whose "
                                                            "probability reaches p (1: all)")
    p.add_argument("--seed", type=int, help="sampling seed (prompt i draws with seed + i; default: the config's seed)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop a completion where TEXT appears (repeatable); the text is cut before it")
    p.add_argument("--ignore_eos", action="store_true",
                   help="generate exactly --max_new_tokens tokens, past any end-of-sequence token (benchmarks)")
