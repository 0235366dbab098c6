"""serve.py: an OpenAI-compatible server of a causal LM or an encoder-decoder under any plan, started
like training.

    python serve.py --config_file C --world N --rank R [--host 127.0.0.1] [--port 8000] [--model_name NAME]

Rank 0 serves HTTP (galaxy.inference.server) on --host (loopback unless told otherwise); every
rank holds its part of the model. Rank 0's main thread is the schedule: it takes the waiting
requests in batches (up to batch_size rows), broadcasts each batch over a gloo group of every
rank, and all ranks generate it together (galaxy.inference.replicas: the dp replicas split its
rows); rank 0 hears each token as it is chosen and streams it. Batches never overlap, so the ranks
can never disagree on which request a collective belongs to. While idle, rank 0 broadcasts a ping
every min(5 s, timeout_s / 4): the others would otherwise wait out timeout_s, and a rank that died
is noticed then. A failed collective (a dead rank) makes the waiting and every later request a
503; rank 0 stops within timeout_s of noticing (the others stop on their own failed collective),
exit status 1. Ctrl-C or SIGTERM on rank 0 stops every rank, status 0. Rank 0 is the mesh's position
0: under mesh_rank_order, the process started as rank mesh_rank_order[0].
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from galaxy.config import ConfigError
from galaxy.distributed.failures import first_line
from galaxy.inference.model import generation_engine, generation_task, inference_model
from galaxy.inference.replicas import generate_all, replica_batch
from galaxy.inference.server import Front
from galaxy.inference.setup import FromSetup, InferenceSetup, prepare_inference
from galaxy.runtime.runners import plan_and_mesh


def add_serve_arguments(p) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address rank 0 listens on (default 127.0.0.1: this machine "
                                                      "only; 0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="rank 0's HTTP port (default 8000)")
    p.add_argument("--model_name", help="the model's name in the API (default: model_path's folder name)")


@dataclass
class ServeJob(FromSetup):
    setup: InferenceSetup
    host: str
    port: int
    model_name: str

    @property
    def what(self) -> str:
        return f"serve {self.model_name!r} on http://{self.host}:{self.port}/v1"


def prepare_serve(cfg, args) -> ServeJob:
    if not 0 < args.port < 65536:
        raise ConfigError(f"--port must be 1..65535, got {args.port}")
    if cfg.plan.position_of(args.rank) == 0 and not args.check:     # the process that will serve
        _check_port(args.host, args.port)
    name = args.model_name or os.path.basename(os.path.normpath(cfg.model_path))
    return ServeJob(prepare_inference(cfg, args.world), args.host, args.port, name)


def _check_port(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ConfigError(f"--host {host} --port {port} cannot be served ({e.strerror}); give another --port, "
                              "or stop what uses it") from None


def run_serve(job: ServeJob, env) -> None:
    cfg = job.cfg
    plan, mesh = plan_and_mesh(cfg, env.world, job.setup.shape)
    model = inference_model(cfg, plan, mesh, resume=job.resume, peft=job.peft, device=env.device,
                            task=generation_task(job.setup.shape))
    engine = generation_engine(model, plan, mesh, job.tokenizer, env.device)
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.timeout_s))   # the schedule's objects
    rows = replica_batch(cfg, plan)
    if env.rank == 0:
        lead(job, engine, control, rows)
    else:
        follow(engine, control, rows)


def _broadcast(message, control):
    box = [message]
    dist.broadcast_object_list(box, src=0, group=control)
    return box[0]


def follow(engine, control, rows: int | list[int]) -> None:
    while True:
        kind, requests = _broadcast(None, control)
        if kind == "stop":
            return
        if kind == "batch":
            generate_all(engine, requests, rows)


def lead(job: ServeJob, engine, control, rows: int | list[int]) -> None:
    """Rank 0: serve HTTP and run the schedule until SIGINT or SIGTERM (then stop every rank) or a
    failed collective (then 503 to all, and raise: the launcher exits 1)."""
    front = Front(job.host, job.port, tokenizer=job.tokenizer, limits=job.setup.limits, model=job.model_name,
                  rows=job.cfg.batch_size)
    # The handlers only ask to stop: raising inside them could cut a broadcast in half (a
    # broadcast_object_list is two collectives), and the other ranks would read garbage.
    previous = {s: signal.signal(s, lambda *_: front.ask_to_stop()) for s in (signal.SIGINT, signal.SIGTERM)}
    front.start()
    print(f"serve.py: serving {job.model_name!r} on http://{job.host}:{job.port}/v1 "
          f"(completions, chat/completions, models)", flush=True)
    try:
        schedule(front, engine, control, rows, job.cfg.timeout_s)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    front.fail("the server is stopping")          # requests still waiting: 503, not a closed socket
    front.stop()
    _broadcast(("stop", None), control)


def schedule(front: Front, engine, control, rows: int | list[int], timeout_s: float) -> None:
    """Take the waiting requests in batches and generate each with every rank; ping while idle
    (every min(5 s, timeout_s / 4), well within the others' wait of timeout_s)."""
    works, heartbeat_s = [], min(5.0, timeout_s / 4)
    try:
        while not front.stopping:
            works = front.take(heartbeat_s)
            if not works:
                if not front.stopping:
                    _broadcast(("ping", None), control)
                continue
            requests = [r for w in works for r in w.asked.requests]
            owner = [(w, i) for w in works for i in range(len(w.asked.requests))]
            _broadcast(("batch", requests), control)

            def hear(index, token, status):
                work, choice = owner[index]
                work.events.put(("token", choice, token, status))
            for (work, choice), done in zip(owner, generate_all(engine, requests, rows, hear)):
                work.events.put(("done", choice, done))
            works = []
    except Exception as e:
        noticed = time.monotonic()
        front.fail(f"the server lost a rank and stops ({first_line(e)})", works)
        sys.stderr.write("serve.py: rank 0: a collective failed (a rank may have died); answering 503 until it "
                         "stops\n")
        # A short window in which clients learn why (503) rather than finding the port closed.
        time.sleep(max(0.0, min(2.0, timeout_s / 2 - (time.monotonic() - noticed))))
        front.stop()
        raise
