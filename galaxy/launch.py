"""Shared entry-point logic for every training script.

An entry script is three lines:

    from galaxy.launch import main
    from galaxy.train.trainer import train_classifier
    main(preset="tp", train_fn=train_classifier, script="pretrain_tp_bert.py",
         default_config="train_config/bert/tp/full.json", model_type="bert")

default_config is read when the command line names no --config_file (or its alias --config), as
Galaxy-LM's scripts did; model_type is the family a config with shape keys and no model_path
builds at random (galaxy.models.random_init). --max_steps and --max_eval_samples override the
config's keys (a quick run of any config: --max_steps 2 --max_eval_samples 8).

and is started either once per rank by hand,

    python pretrain_tp_bert.py --config_file c.json --world 2 --rank 0 --init_method tcp://HOST:PORT

or by torchrun (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT in the environment: env://).
--rank (RANK) is the launch rank; the process group's rank is the mesh position the config's
mesh_rank_order gives it (DistEnv).
By hand, --init_method defaults to tcp://127.0.0.1:29500, i.e. all ranks on this machine;
give the address of rank 0's host to span machines: each rank then binds its collectives to the
interface that routes there unless GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME name one
(galaxy.distributed.interface). A single process (--world 1, the
default) rendezvouses through an in-memory store, so two serial runs never share a port.

Before any process group starts, the config, the data, the model's weights and tokenizer, the
output paths and the plan are checked (galaxy.config, the script's prepare function,
galaxy.preflight); --check stops there and prints what would run. The rendezvous then checks that
every rank runs the same settings and world size and that the port is this job's
(galaxy.distributed.agreement).

Exit status: 0 success; 2 a config or argument error, reported as one line before any
process group starts, or ranks started with different settings; 1 a failed rendezvous (port in
use, a rank that never came), a failed or timed-out collective (e.g. a peer died), or an error in
training (a non-finite loss: one line); 130 Ctrl-C. Waiting for peers, at rendezvous or in a
collective, is bounded by the config's timeout_s.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import socket
import sys
import traceback
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from galaxy import preflight
from galaxy.config import ConfigError, apply_preset, load_config, validate_for_world
from galaxy.data.errors import DataError
from galaxy.distributed import waiting
from galaxy.distributed.agreement import Disagreement, RendezvousError, agree, fingerprint, open_store
from galaxy.distributed.failures import first_line as _first_line
from galaxy.distributed.interface import bind_to_rendezvous
from galaxy.models.build import CheckpointError
from galaxy.models.shape import read_model_shape
from galaxy.pipeline.schedule import ENGINE_VARIABLE, overlapped_engine
from galaxy.preflight.summary import summary as preflight_summary
from galaxy.runtime import cpu_allocator

DEFAULT_INIT_METHOD = "tcp://127.0.0.1:29500"

# How a communication failure reads when gloo raises a plain RuntimeError instead of a
# DistError; anything else from train_fn is treated as a bug and gets its traceback.
_COMM_FAILURE = re.compile(r"gloo|nccl|connection|peer|timed out|timeout|socket|broken pipe",
                           re.IGNORECASE)


@dataclass
class DistEnv:
    """rank: the mesh position, the default group's rank (what addresses the mesh: stages,
    replicas, Galaxy ranks, the lead at 0); launch_rank: the process as the user started it
    (--rank, RANK), what a user reads about a device (error lines, per-device figures).
    They differ only under mesh_rank_order (rank = its index of launch_rank)."""
    rank: int
    world: int
    backend: str
    device: torch.device  # cuda:{local_rank} under nccl, else cpu
    timeout_s: float
    local_rank: int
    launch_rank: int


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        # argparse prints the usage block first; with several ranks writing to one terminal
        # a single line is easier to find.
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def parse_args(argv, script: str, add_arguments=None, default_config: str | None = None) -> argparse.Namespace:
    """Parse the command line; the result always has world, rank, init_method, local_rank.

    init_method is None only for a single process started by hand (in-memory store);
    init_method_defaulted / config_defaulted say the command line did not give them.
    add_arguments(parser), when given, adds a script's own options (e.g. --generate).
    """
    p = _Parser(prog=script, description="Train with the settings in a Galaxy JSON config.")
    p.add_argument("--config_file", "--config", dest="config_file", required=default_config is None,
                   metavar="PATH",
                   help="JSON config file" + (f" (default {default_config})" if default_config else ""))
    p.add_argument("--max_steps", type=int, metavar="N", help="override the config's max_steps")
    p.add_argument("--max_eval_samples", type=int, metavar="N",
                   help="override the config's max_eval_samples (evaluate the first N dev / test examples)")
    p.add_argument("--world", type=int, metavar="N", help="number of processes (default 1)")
    p.add_argument("--rank", type=int, metavar="R", help="this process's rank (default 0)")
    p.add_argument("--init_method", metavar="URL",
                   help=f"rendezvous address (default {DEFAULT_INIT_METHOD} when --world > 1)")
    p.add_argument("--check", action="store_true",
                   help="check the config, data, model, paths and plan, print what would run, and exit")
    if add_arguments is not None:
        add_arguments(p)
    args = p.parse_args(argv)
    args.init_method_defaulted = False
    args.config_defaulted = args.config_file is None
    if args.config_defaulted:
        args.config_file = default_config
    for flag in ("max_steps", "max_eval_samples"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            p.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")

    _world_and_rank(p, args)
    return args


def _world_and_rank(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """world, rank, init_method (and local_rank) from torchrun's environment or the command line."""
    env_rank, env_world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    args.local_rank = None
    if env_rank is not None and env_world is not None:  # started by torchrun
        try:
            rank, world = int(env_rank), int(env_world)
            local = os.environ.get("LOCAL_RANK")
            args.local_rank = int(local) if local else None
        except ValueError:
            p.error(f"RANK={env_rank!r}, WORLD_SIZE={env_world!r} and LOCAL_RANK in the "
                    f"environment must be integers")
        for flag, given, name, value in (("--world", args.world, "WORLD_SIZE", world),
                                         ("--rank", args.rank, "RANK", rank)):
            if given is not None and given != value:
                p.error(f"{flag} {given} disagrees with {name}={value} from torchrun; drop {flag}")
        if args.init_method not in (None, "env://"):
            p.error(f"--init_method {args.init_method} conflicts with torchrun's env:// "
                    f"rendezvous; drop --init_method")
        args.world, args.rank, args.init_method = world, rank, "env://"
    else:
        args.world = 1 if args.world is None else args.world
        args.rank = 0 if args.rank is None else args.rank
        if args.init_method is None and args.world > 1:
            args.init_method, args.init_method_defaulted = DEFAULT_INIT_METHOD, True
    if args.init_method is not None and not args.init_method.startswith(("tcp://", "file://", "env://")):
        p.error(f"--init_method {args.init_method} must start with tcp://, file:// or env://")
    if args.init_method is not None and args.init_method.startswith("tcp://"):
        problem = _tcp_problem(args.init_method)
        if problem:
            p.error(f"--init_method {args.init_method} {problem}; give tcp://HOST:PORT with rank 0's address "
                    f"(e.g. {DEFAULT_INIT_METHOD})")


def _tcp_problem(url: str) -> str | None:
    try:
        parsed = urlparse(url)
        port = parsed.port           # raises ValueError when not a number in 0..65535
    except ValueError:
        return "has a port that is not a number from 1 to 65535"
    if not parsed.hostname:
        return "has no host"
    if port is None or port == 0:
        return "has no port"
    return None


def init_distributed(cfg, args, settings: dict | None = None) -> DistEnv:
    """Start the default process group (even for one process, so code paths stay the same).

    settings: this rank's fingerprint (galaxy.distributed.agreement); every rank's must be equal,
    else Disagreement is raised before the process group starts.

    The store and the agreement go by launch rank (launch rank 0 hosts the store, at the address
    users give); the process group's rank is the mesh position cfg's mesh_rank_order gives that
    launch rank, so every group built on it (mesh, pipeline peers, DP, data shards) follows.
    """
    backend = cfg.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if cfg.pipeline_warmup_list is not None and not overlapped_engine(backend):   # torch's fix them at pp - p
        why, fix = ((f"the backend is {backend!r}", "set distributed_backend to 'gloo'") if backend != "gloo" else
                    (f"{ENGINE_VARIABLE}=torch picks torch's schedules", f"unset {ENGINE_VARIABLE}"))
        raise ConfigError(f"pipeline_warmup_list runs only on Galaxy's pipeline engine over gloo, but {why}; "
                          f"{fix} or remove pipeline_warmup_list")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ConfigError("distributed_backend is 'nccl' but no CUDA device is visible; "
                              "use 'gloo' or remove the key")
        local_rank = args.local_rank
        if local_rank is None:  # started by hand: ranks on one host share its GPUs in turn
            local_rank = args.rank % torch.cuda.device_count()
        torch.cuda.set_device(local_rank)  # before init, so NCCL binds the right GPU
        device = torch.device("cuda", local_rank)
    else:
        local_rank = args.rank if args.local_rank is None else args.local_rank
        device = torch.device("cpu")
    # The timeout bounds both the rendezvous (waiting for peers to show up) and every
    # collective afterwards, so a dead peer turns into an error instead of a hang.
    timeout = timedelta(seconds=cfg.timeout_s)
    if args.init_method is None:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
    else:
        store = open_store(args.init_method, args.rank, args.world, timeout)
        agree(store, args.rank, args.world, settings or {"--world": args.world}, cfg.timeout_s)
        # The prefix init_process_group itself puts on a store it creates.
        dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store),
                                rank=cfg.plan.position_of(args.rank), world_size=args.world, timeout=timeout)
    # Every rank has the same comm_wait and backend, so all or none join the all-gather.
    on_host = ranks_and_cores_on_this_host() if backend == "gloo" and cfg.comm_wait == "auto" else (1, 1)
    waiting.set_polling(waiting.choose_poll(cfg.comm_wait, backend, *on_host))
    cpu_allocator.apply(cfg.cpu_allocator, device.type)
    return DistEnv(rank=dist.get_rank(), world=args.world, backend=backend, device=device,
                   timeout_s=cfg.timeout_s, local_rank=local_rank, launch_rank=args.rank)


def ranks_and_cores_on_this_host() -> tuple[int, int]:
    """(ranks of the default group on this host, cores they may use together): one all-gather of
    every rank's host name and CPU affinity, so that ranks pinned one to a core count as a core each."""
    cores = sorted(waiting.usable_core_ids())
    if dist.get_world_size() == 1:
        return 1, len(cores)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (socket.gethostname(), cores))
    here = [c for host, c in every if host == socket.gethostname()]
    return len(here), len(set().union(*here))


def _hard_exit(status: int, message: str | None = None) -> None:
    """Exit without Python teardown: with a live process group, destroy_process_group or
    interpreter shutdown can block on a peer that is gone."""
    if message:
        # A progress bar leaves its line open (it redraws it with \r): start on a line of our own.
        sys.stderr.write(("\n" if _bar_on_screen() else "") + message + "\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _bar_on_screen() -> bool:
    from tqdm import tqdm
    return any(not bar.disable for bar in list(getattr(tqdm, "_instances", ())))


def load_run_config(args, preset: str, script: str, model_type: str | None = None, config_fn=None):
    """The config a run uses: the file (Galaxy-LM keys translated), the command line's overrides,
    the script's preset, the model (a random one built now for shape keys without model_path),
    checked for this world and rank. Rank 0 prints the notes and the ignored keys. config_fn:
    main's.
    Raises ConfigError (every problem of a stage at once) before any process group starts."""
    from galaxy.models.random_init import ensure_model
    if args.config_defaulted and not os.path.isfile(args.config_file):
        raise ConfigError(f"no --config_file given and the default {args.config_file} is not in the "
                          f"current directory {os.getcwd()!r}; run from the repository root or give --config_file")
    cfg = load_config(args.config_file)
    if config_fn is not None:
        cfg = config_fn(cfg)
    overrides = {k: getattr(args, k) for k in ("max_steps", "max_eval_samples") if getattr(args, k) is not None}
    if overrides:
        cfg = dataclasses.replace(cfg, **overrides, _given=cfg._given | set(overrides))
    cfg = apply_preset(cfg, preset, script, args.world)
    cfg = ensure_model(cfg, model_type)
    if cfg.init_method is not None and args.init_method_defaulted:
        args.init_method = cfg.init_method       # Galaxy-LM kept the rendezvous address in the config
    if args.rank == 0:
        for note in cfg._notes:
            print(f"{script}: note: {note}", flush=True)
        if cfg._ignored:
            sys.stderr.write(f"{script}: warning: ignoring keys with no meaning here: "
                             f"{', '.join(cfg._ignored)}\n")
    validate_for_world(cfg, args.world, args.rank, read_model_shape(cfg.model_path))
    preflight.check_output_paths(cfg)
    return cfg


def _report(script: str, error: Exception) -> None:
    """One line per problem (a ConfigError may hold several)."""
    for line in str(error).splitlines() or [type(error).__name__]:
        sys.stderr.write(f"{script}: error: {line}\n")


def main(preset: str, train_fn, script: str, argv=None, prepare_fn=None, add_arguments=None,
         default_config: str | None = None, model_type: str | None = None, config_fn=None) -> None:
    """parse args -> load, preset and check the config (load_run_config) and output paths ->
    prepare_fn -> model checks (galaxy.preflight) -> [--check: print the summary, return] ->
    rendezvous and agreement -> init the process group -> train_fn.

    prepare_fn(cfg) (optional) reads what the job needs from disk (data, tokenizer) before any
    process group starts, so a user's mistake there is also a one-line exit 2; its result is
    what train_fn receives in place of cfg: train_fn(prepare_fn(cfg), env). A script that adds
    its own options with add_arguments(parser) gets them too: prepare_fn(cfg, args).

    config_fn(cfg) (optional) returns the config to check and run in place of the loaded one (a
    job that measures rather than trains, e.g. plan.py profile-devices, drops the base config's
    plan, which need not fit the world it measures).

    Returns normally (exit status 0) on success; every failure exits, see the module docstring.
    """
    args = parse_args(argv, script, add_arguments, default_config)
    cfg, job, report, settings = _checked_job(args, preset, script, model_type, config_fn, prepare_fn,
                                              add_arguments)
    if args.rank == 0:
        for line in report.warnings:
            sys.stderr.write(f"{script}: {line}\n")
    if args.check:
        print(preflight_summary(cfg, job, report, script, args.rank, args.world), flush=True)
        return
    env = _rendezvous(cfg, args, settings, script)
    _run(train_fn, job, env, script)


def _checked_job(args, preset, script, model_type, config_fn, prepare_fn, add_arguments):
    """(config, job, preflight report, settings fingerprint): every check before any process group;
    a user's mistake exits 2 with one line per problem."""
    try:
        cfg = load_run_config(args, preset, script, model_type, config_fn)
        if prepare_fn is None:
            job = cfg
        else:
            job = prepare_fn(cfg, args) if add_arguments is not None else prepare_fn(cfg)
        # A script with a prepare function builds a model: check it against its weights.
        report = preflight.check_job(cfg, job) if prepare_fn is not None else preflight.Report()
        return cfg, job, report, fingerprint(cfg, job, args, script)
    except (ConfigError, DataError, CheckpointError, FileNotFoundError) as e:
        _report(script, e)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


def _rendezvous(cfg, args, settings, script: str) -> DistEnv:
    """The process group, or an exit naming what failed (status 2: ranks disagree; 1: the rendezvous)."""
    via = bind_to_rendezvous(args.init_method)      # "" on loopback: nothing changes there
    try:
        return init_distributed(cfg, args, settings)
    except ConfigError as e:  # raised before init_process_group
        _report(script, e)
        sys.exit(2)
    except Disagreement as e:  # every rank reaches it, before init_process_group
        _hard_exit(2, f"{script}: rank {args.rank}: error: {e}")
    except RendezvousError as e:
        _hard_exit(1, f"{script}: rank {args.rank}: rendezvous at {args.init_method}{via} failed: {e}")
    except KeyboardInterrupt:
        _hard_exit(130)
    except Exception as e:
        _hard_exit(1, f"{script}: rank {args.rank}: rendezvous at {args.init_method or 'local store'}{via} "
                      f"failed (waited up to timeout_s={cfg.timeout_s:g}; did all {args.world} ranks "
                      f"start with the same --world and --init_method?): {_first_line(e)}")


def _run(train_fn, job, env: DistEnv, script: str) -> None:
    """train_fn(job, env), every failure one line and its exit status (module docstring)."""
    try:
        train_fn(job, env)
    except KeyboardInterrupt:
        _hard_exit(130)
    except FloatingPointError as e:   # the loss diverged: what happened and the step, not a bug
        _hard_exit(1, f"{script}: rank {env.launch_rank}: training stopped: {_first_line(e)}")
    except Exception as e:
        if isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and _COMM_FAILURE.search(str(e))):
            _hard_exit(1, f"{script}: rank {env.launch_rank}: a collective failed or timed out "
                          f"(a peer may have died): {_first_line(e)}")
        traceback.print_exc()
        _hard_exit(1, f"{script}: rank {env.launch_rank}: training failed: {_first_line(e)}")
    dist.destroy_process_group()
