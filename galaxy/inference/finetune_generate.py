"""finetune_llama.py's jobs: train (the shared trainer), --generate a greedy continuation, or (a Llama
classifier) --predict / train false (galaxy.inference.predict); finetune_bart.py's and
finetune_t5.py's: train or --generate.

    finetune_llama.py --config_file C [--world N --rank R] --generate "PROMPT" --max_new_tokens K

loads the weights (model_path, or the checkpoint named by `resume`, with the config's PEFT
method), does not train, and prints the prompt with its greedy continuation and the token ids
(rank 0), under any plan and mesh of the config: generate.py's job with one prompt.
"""
from __future__ import annotations

from argparse import Namespace

from galaxy.inference.generate_job import GenerateJob, requests_job, run_generate
from galaxy.inference.predict import PredictJob, add_predict_arguments, prepare_predict, run_predict, wants_prediction
from galaxy.inference.prompts import Prompt
from galaxy.train.trainer import Job, prepare_causal_lm, prepare_seq2seq, train


def add_greedy_arguments(parser) -> None:
    parser.add_argument("--generate", metavar="PROMPT", help="print the greedy continuation of PROMPT; no training")
    parser.add_argument("--max_new_tokens", type=int, default=32, metavar="K",
                        help="tokens to generate with --generate (default 32)")


def add_generation_arguments(parser) -> None:
    add_greedy_arguments(parser)
    add_predict_arguments(parser)      # a Llama classifier (task classification) predicts like BERT


def prepare_llama(cfg, args):
    if args.generate is None and wants_prediction(cfg, args):
        return prepare_predict(cfg, args, script_task="causal_lm")
    if args.generate is None:
        return prepare_causal_lm(cfg)
    return greedy_job(cfg, args)


def prepare_encoder_decoder(cfg, args):
    """finetune_bart.py / finetune_t5.py: train, or --generate (galaxy.inference.seq2seq_engine)."""
    return prepare_seq2seq(cfg) if args.generate is None else greedy_job(cfg, args)


def greedy_job(cfg, args) -> GenerateJob:
    """generate.py's job for --generate PROMPT: greedy, printing the text and the token ids."""
    greedy = Namespace(max_new_tokens=args.max_new_tokens, temperature=0.0, top_k=0, top_p=1.0, seed=None, stop=[],
                       ignore_eos=False, chat=False, world=args.world, prompts=None, num_beams=1,
                       length_penalty=1.0, early_stopping="false")
    return GenerateJob(*requests_job(cfg, greedy, [Prompt(args.generate)]), out=None, echo=True)


def run_llama(job, env):
    if isinstance(job, PredictJob):
        return run_predict(job, env)
    return train(job, env) if isinstance(job, Job) else run_generate(job, env)


def run_encoder_decoder(job, env):
    return train(job, env) if isinstance(job, Job) else run_generate(job, env)
