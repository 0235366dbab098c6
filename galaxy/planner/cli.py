"""plan.py: profile the devices and the model, search the fastest plan that fits, write its config.

    python plan.py profile-devices --config_file base.json --world 2 --rank R --out profiles/devices.json
    python plan.py profile-model --config_file base.json --out profiles/model.json
    python plan.py search --config_file base.json --devices profiles/devices.json \\
        --model profiles/model.json --memory_mib 4000 2000 --out train_config/bert/planned.json [--png plan.png]
        [--pp N ...] [--dp N ...] [--json plans.json]

The search costs the run the base config asks for: its PEFT method (use_lora, use_adapter,
use_side, use_side_only) with the figures profile-model and profile-devices took for it.

profile-devices runs as training runs (galaxy.launch: one process per rank by hand or torchrun,
timeout_s, exit codes); with --compose it joins devices profiled alone and a link into one
cluster description instead (no process group). profile-model and search run in one process.
Exit status: 0 done; 2 a mistake in the arguments, the config or a profile (one line), or no plan
that fits (one line naming the budget that is short and by how much); 1 as training's.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from types import SimpleNamespace

from galaxy.config import ConfigError, apply_preset, load_config, with_plan
from galaxy.config.world import target_tokens
from galaxy.data import load_examples
from galaxy.data.errors import DataError
from galaxy.launch import main as launch_main
from galaxy.models.registry import family_of
from galaxy.models.shape import read_model_shape
from galaxy.plan import DP_SHARDING, Plan
from galaxy.planner.cost import CostModel
from galaxy.planner.device_compute import model_signature, tables_match
from galaxy.planner.device_profile import run as profile_devices_run
from galaxy.planner.draw import draw_plan
from galaxy.planner.encdec_cost import EncDecCostModel
from galaxy.planner.encdec_profile import profile_encdec_model
from galaxy.planner.encdec_profile import summary as encdec_summary
from galaxy.planner.method import config_signature
from galaxy.planner.model_profile import ModelProfileError, check_method, check_model_profile, profile_model
from galaxy.planner.profiles import ProfileError, compose, read_json, write_json
from galaxy.planner.encdec_search import search_encdec
from galaxy.planner.latency_search import add_objective_arguments
from galaxy.planner.search import divisors, search
from galaxy.planner.table import mib, no_fit_line, table
from galaxy.planner.writer import ranked_document, write_planned_config

PROG = "plan.py"
# Plans stay this many percent under each budget: the memory model's predictions of peak RSS are
# within about 5% of measured (bench/plan_accuracy.py), on both sides, so a plan predicted at the
# budget itself can go over it.
HEADROOM_PCT = 5.0
SCRIPTS = {"classification": "pretrain_galaxy.py", "causal_lm": "finetune_llama.py"}


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def fail(command: str, message: str, status: int = 2):
    sys.stderr.write(f"{PROG} {command}: error: {' '.join(str(message).splitlines())}\n")
    sys.exit(status)


def num_labels_of(cfg, family) -> int | None:
    """The classifier's outputs the trainer would build (classification families), else None."""
    if "classification" not in family.tasks:
        return None
    names = cfg.class_list
    if names is None:
        names = load_examples(cfg.train_path, "train")[1]
    return len(names)


def measuring_config(cfg):
    """The base config with its plan and outputs dropped: profiling measures, at any world."""
    outputs = dict(metrics_file=None, save_dir=None, save_interval=None, keep_checkpoints=None, export_dir=None,
                   resume=None)
    return with_plan(dataclasses.replace(cfg, **outputs, _given=frozenset(cfg._given) - set(outputs)),
                     Plan.preset("sp"))


# --- profile-devices -----------------------------------------------------------------------------

@dataclasses.dataclass
class DevicesJob:
    cfg: object
    opts: argparse.Namespace
    num_labels: int | None


def _devices_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Measure every rank's device (the model's sub-blocks at a grid of shares, a GEMM, the "
                     "optimizer, memory) and the collectives between them; rank 0 writes --out. "
                     "Or, with --compose DEVICES.json [...] [--link LINK.json] --out PATH, join devices profiled "
                     "apart into one devices profile (no process group).")
    p.add_argument("--out", required=True, metavar="PATH", help="devices profile to write (rank 0)")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds per measurement (default 5)")
    p.add_argument("--statistic", choices=("median", "min", "mean"), default=None,
                   help="of the compute rounds (the link keeps the mean of all its calls; default: mean on a rank "
                        "under a CPU quota without --quick, else median): median (what a step meets under the machine's usual load), "
                        "min (the device unloaded: for a machine shared with other work while profiling) or "
                        "mean (time-weighted over at least 0.1 s of each point: for a device that shares its "
                        "core with other work while training too)")
    p.add_argument("--quick", action="store_true", help="fewer shares, rows, sizes and repeats (tests)")
    p.add_argument("--objective", choices=("step", "latency"), default="step",
                   help="step: what training plans read (default); latency: only what search --objective latency "
                        "reads (forward at pad_size, a causal LM's decode step, the one-token calls), small enough for "
                        "a small device")


def _devices_prepare(cfg, opts) -> DevicesJob:
    if opts.repeats < 1:
        raise ConfigError("--repeats must be at least 1")
    shape = read_model_shape(cfg.model_path)
    family = family_of(shape["model_type"])
    if opts.objective == "latency" and next(iter(family.tasks)) not in ("causal_lm", "classification"):
        raise ConfigError("profile-devices --objective latency profiles causal LMs and encoder classifiers (what "
                          "search --objective latency plans); drop --objective latency for this config")
    if shape.get("is_encoder_decoder"):      # no compute table yet: the GEMM rate, memory, optimizer, link
        config_signature(cfg, family)        # two method flags: refused here as for the other families
        return DevicesJob(cfg, opts, None)
    return DevicesJob(cfg, opts, num_labels_of(cfg, family))


def profile_devices(argv) -> None:
    if "--compose" in argv:
        return compose_devices(argv)
    launch_main(preset="galaxy", train_fn=profile_devices_run, script=f"{PROG} profile-devices", argv=argv,
                prepare_fn=_devices_prepare, add_arguments=_devices_arguments, config_fn=measuring_config)


def compose_devices(argv) -> None:
    p = _Parser(prog=f"{PROG} profile-devices",
                description="Join devices profiled alone (in rank order) and a link into one devices profile.")
    p.add_argument("--compose", nargs="+", required=True, metavar="DEVICES.json",
                   help="devices profiles, one per rank (a file may hold several ranks, or be named twice)")
    p.add_argument("--link", metavar="LINK.json", help="link profile, or a devices profile taken on 2+ ranks")
    p.add_argument("--out", required=True, metavar="PATH")
    args = p.parse_args(argv)
    try:
        doc = compose(args.compose, args.link)
        write_json(args.out, doc)
    except ProfileError as e:
        fail("profile-devices", e)
    print(f"wrote {args.out}: {len(doc['devices'])} devices"
          f"{', link ' + doc['link'].get('backend', 'given') if doc['link'] else ''}")


# --- profile-model ----------------------------------------------------------------------------------

def profile_model_command(argv) -> None:
    p = _Parser(prog=f"{PROG} profile-model",
                description="Measure the model's parameters, activation bytes and FLOPs per sub-block at any share.")
    p.add_argument("--config_file", required=True, metavar="PATH", help="the base JSON config (model, pad_size)")
    p.add_argument("--out", required=True, metavar="PATH", help="model profile to write")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config_file)
        shape = read_model_shape(cfg.model_path)
        if cfg.pad_size > shape["max_position_embeddings"]:
            raise ConfigError(f"pad_size {cfg.pad_size} exceeds the model's max_position_embeddings "
                              f"{shape['max_position_embeddings']}; lower pad_size")
        family = family_of(shape["model_type"])
        if shape.get("is_encoder_decoder"):
            config_signature(cfg, family)
            classifier = (cfg.task or next(iter(family.tasks))) == "classification"   # the LM's by default
            doc = profile_encdec_model(cfg, num_labels_of(cfg, family) if classifier else None)
        else:
            doc = profile_model(cfg, num_labels_of(cfg, family))
        write_json(args.out, doc)
    except (ConfigError, DataError, FileNotFoundError) as e:
        fail("profile-model", e)
    if doc.get("encoder_decoder"):
        print(encdec_summary(doc))
        print(f"wrote {args.out}")
        return
    per_layer = doc["params"]["per_layer"]
    acts = doc["profiler"]["layer_act_bytes_per_row"]
    print(f"{doc['family']} {doc['model_type']}: {doc['params']['total']:,} parameters ({per_layer:,} per layer), "
          f"{sum(acts.values()) / 2 ** 20:.2f} MiB saved for backward per row per layer at pad_size "
          f"{doc['pad_size']}; forward FLOPs per row of a layer and head "
          f"{doc['profiler']['fwd_flops_per_row_one_layer']:,} "
          f"({'equal to' if doc['profiler']['flops_match_closed_form'] else 'DIFFERS from'} the closed form)")
    print(f"wrote {args.out}")


# --- search -----------------------------------------------------------------------------------------

def _search_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=f"{PROG} search",
                description="Search the fastest plan that fits every rank's memory; write it as a train config.")
    p.add_argument("--config_file", required=True, metavar="PATH", help="the base JSON config (its other keys are kept)")
    p.add_argument("--devices", required=True, nargs="+", metavar="PATH",
                   help="devices profile(s), in rank order: one cluster file, or one per device (with --link)")
    p.add_argument("--link", metavar="PATH", help="link profile, when --devices were profiled apart")
    p.add_argument("--model", required=True, metavar="PATH", help="model profile (plan.py profile-model)")
    p.add_argument("--memory_mib", nargs="+", type=float, metavar="MIB",
                   help="memory budget per rank (one value: every rank; default: each device's memory_mib)")
    p.add_argument("--headroom", type=float, default=HEADROOM_PCT, metavar="PCT",
                   help=f"plan every rank to at most its budget less PCT%% (default {HEADROOM_PCT:g}: the memory "
                        "model's error; 0 plans to the budget itself)")
    p.add_argument("--out", required=True, metavar="PATH", help="the train config to write")
    p.add_argument("--png", metavar="PATH", help="also draw the chosen plan")
    p.add_argument("--json", metavar="PATH",
                   help="also write the ranked plans, best first ({\"plans\": [{\"keys\", \"predicted_step_s\", "
                        "...}]}; when none fits, each rank's shortfall_mib)")
    p.add_argument("--top", type=int, default=5, help="plans to print (default 5)")
    p.add_argument("--pp", type=int, nargs="+", metavar="N",
                   help="search only these pipeline degrees (default: every divisor of the world)")
    p.add_argument("--dp", type=int, nargs="+", metavar="N",
                   help="search only these data-parallel degrees (--pp 1 --dp 1: one Galaxy group of every rank)")
    add_objective_arguments(p)
    return p


def meshes_of(pps, dps, world: int, layers: int) -> list[tuple[int, int]] | None:
    """The (pp, dp) pairs --pp / --dp allow (None: every one); ConfigError for a degree no plan can have."""
    if pps is None and dps is None:
        return None
    for flag, values in (("--pp", pps), ("--dp", dps)):
        for v in values or ():
            if v < 1 or world % v:
                raise ConfigError(f"{flag} {v} does not divide the world of {world} devices; give a divisor of {world}")
    for v in pps or ():
        if v > layers:
            raise ConfigError(f"--pp {v} is more stages than the model's {layers} layers")
    divs = divisors(world)
    meshes = [(pp, dp) for pp in (pps or divs) for dp in (dps or divs) if world % (pp * dp) == 0]
    if not meshes:
        raise ConfigError(f"--pp {' '.join(map(str, pps or divs))} with --dp {' '.join(map(str, dps or divs))} "
                          f"leaves no mesh of {world} devices (pp x dp must divide the world)")
    return meshes


def _check_model_matches(model: dict, shape: dict, cfg, where: str) -> None:
    hf = model["hf_config"]
    for key in ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        if hf.get(key) != shape.get(key):
            raise ConfigError(f"model profile {where} is of a model with {key} {hf.get(key)!r}, but the config's "
                              f"model_path has {shape.get(key)!r}; run plan.py profile-model on this config")
    if model["pad_size"] != cfg.pad_size:
        raise ConfigError(f"model profile {where} was taken at pad_size {model['pad_size']}, the config has "
                          f"{cfg.pad_size}; run plan.py profile-model on this config")


def _budgets(args, devices, link) -> list[float]:
    world = len(devices)
    budgets = args.memory_mib or [d["memory_mib"] for d in devices]
    if len(budgets) == 1:
        budgets = budgets * world
    if len(budgets) != world:
        raise ConfigError(f"--memory_mib gives {len(budgets)} budgets for {world} devices; give one per rank "
                          f"or one for all")
    if world > 1 and link is None:
        raise ProfileError("several devices but no link; give --link")
    if args.top < 1:
        raise ConfigError("--top must be at least 1")
    if not 0 <= args.headroom < 50:
        raise ConfigError(f"--headroom {args.headroom:g} is not a percentage from 0 to 50; the default is {HEADROOM_PCT:g}")
    return [b * (1 - args.headroom / 100) for b in budgets]


def _notes(model: dict, devices: list[dict], method: dict | None) -> list[str]:
    """What the search could not time as measured: compute tables of another model, or none for
    the config's PEFT method (the full fine-tuning table stands in)."""
    notes, signature = [], model_signature(model)
    for r, d in enumerate(devices):
        if d.get("compute") and not tables_match(d, signature):
            notes.append(f"note: rank {r}'s compute table was measured for another model or pad_size; "
                         f"timing it by its GEMM rate")
        elif method and (d.get("compute") or {}).get("peft", {}).get("signature") != method["signature"]:
            notes.append(f"note: rank {r}'s device profile has no table for {method['description']}; "
                         f"timing it by the full fine-tuning table (weight gradients counted: an upper bound); "
                         f"run plan.py profile-devices on this config")
    return notes


def _search_inputs(args) -> SimpleNamespace:
    """The config, profiles and cost model of a search (ConfigError, ProfileError, ...)."""
    cfg = apply_preset(load_config(args.config_file), "galaxy")
    shape = read_model_shape(cfg.model_path)
    model = check_model_profile(read_json(args.model), args.model)
    if model.get("encoder_decoder") or shape.get("is_encoder_decoder"):
        return _encdec_search_inputs(args, cfg, shape, model)
    _check_model_matches(model, shape, cfg, args.model)
    parts = _cost_parts(args, cfg, shape, model, CostModel)
    return SimpleNamespace(**vars(parts), notes=_notes(model, parts.devices, parts.method),
                           script=SCRIPTS.get(model["task"], "pretrain_galaxy.py"),
                           search=lambda top: search(parts.cost, parts.budgets, top=top, dp_sharding=DP_SHARDING,
                                                     meshes=parts.meshes))


def _cost_parts(args, cfg, shape: dict, model: dict, cost_model) -> SimpleNamespace:
    """What every search reads: the method, the devices and link, budgets, meshes, the cost model
    (cost_model: CostModel or EncDecCostModel) and the parameter counts."""
    signature = config_signature(cfg, family_of(shape["model_type"]))
    method = check_method(model, signature, args.model)
    clus = compose(args.devices, args.link)
    devices, link = clus["devices"], clus["link"]
    if any(d.get("objective") == "latency" for d in devices):
        raise ProfileError("the devices were profiled with --objective latency (forward only, no backward or optimizer "
                           "timed); run plan.py profile-devices without it for training plans")
    budgets = _budgets(args, devices, link)
    meshes = meshes_of(args.pp, args.dp, len(devices), shape["num_hidden_layers"])
    cost = cost_model(model, devices, link, batch_size=cfg.batch_size, optimizer=cfg.optimizer, method=signature)
    counts = method or model        # a method's section counts the model it makes, its own parameters too
    return SimpleNamespace(cfg=cfg, shape=shape, model=model, devices=devices, budgets=budgets, meshes=meshes,
                           cost=cost, method=method, total=counts["params"]["total"],
                           trainable=counts["trainable" if method else "params"]["total"])


def _encdec_search_inputs(args, cfg, shape: dict, model: dict) -> SimpleNamespace:
    """An encoder-decoder's search (galaxy.planner.encdec_search)."""
    if not model.get("encoder_decoder"):
        raise ModelProfileError(f"model profile {args.model} is not an encoder-decoder's; run plan.py profile-model "
                                "on this config")
    task, enc, dec = cfg.task or next(iter(family_of(shape["model_type"]).tasks)), *model["stacks"].values()
    for what, theirs, ours in (("model_type", model["model_type"], shape["model_type"]), ("task", model["task"], task),
                               ("num_attention_heads", enc["units"]["att_tp"][0], shape["num_attention_heads"]),
                               ("intermediate_size", enc["units"]["mlp_tp"][0], shape["intermediate_size"]),
                               ("num_hidden_layers", enc["layers"] + dec["layers"], shape["num_hidden_layers"]),
                               ("pad_size", model["pad_size"], cfg.pad_size),
                               ("target_pad_size", model["target_pad_size"], target_tokens(cfg))):
        if theirs != ours:
            raise ConfigError(f"model profile {args.model} was taken for {what} {theirs!r}, the config has {ours!r}; "
                              "run plan.py profile-model on this config")
    parts = _cost_parts(args, cfg, shape, model, EncDecCostModel)
    return SimpleNamespace(**vars(parts), notes=[], script=f"finetune_{model['model_type']}.py",
                           search=lambda top: search_encdec(parts.cost, parts.budgets, top=top, dp_sharding=DP_SHARDING,
                                                            meshes=parts.meshes))


def search_command(argv) -> None:
    args = _search_parser().parse_args(argv)
    if args.objective == "latency":
        from galaxy.planner.latency_cli import latency_search_command     # it imports this module's helpers
        return latency_search_command(args)
    if args.prompt_tokens is not None or args.new_tokens is not None:
        fail("search", "--prompt_tokens and --new_tokens size a generation request; add --objective latency")
    try:
        run = _search_inputs(args)
        result = run.search(args.top)
    except (ConfigError, ProfileError, ModelProfileError, DataError, FileNotFoundError) as e:
        fail("search", e)
    layers = run.shape["num_hidden_layers"]
    if args.json:
        write_json(args.json, ranked_document(result, layers, run.trainable))
    if not result.ranked:
        fail("search", no_fit_line(result, run.devices, args.headroom))
    cfg, world = run.cfg, len(run.devices)
    for line in run.notes:
        print(line)
    what = run.method["description"] if run.method else "full fine-tuning"
    print(f"{what}: {run.trainable:,} of {run.total:,} parameters train (gradients, optimizer state and "
          f"gradient sync cover only these)")
    print(f"searched {result.tried:,} plans in {result.seconds:.1f} s: world {world}, batch {cfg.batch_size}, "
          f"pad_size {cfg.pad_size}, {layers} layers, memory budgets (MiB) "
          f"{', '.join(mib(b) for b in run.budgets)}" + (f" ({args.headroom:g}% headroom kept)" if args.headroom else ""))
    print(table(result.ranked))
    best = result.ranked[0]
    try:
        write_planned_config(args.config_file, best, args.out, shape=run.shape, budgets=run.budgets,
                             trainable=run.trainable)
    except ConfigError as e:     # a plan the engine refuses is a planner bug: say so, loudly
        fail("search", f"the written config fails galaxy.config's checks (a planner bug): {e}", 1)
    command = f"python {run.script} --config_file {args.out}" + (f" --world {world} --rank R" if world > 1 else "")
    print(f"wrote {args.out}" + (f" and {args.json}" if args.json else "") + f"; train it with: {command}")
    if args.png:
        drawn = run.model if not run.model.get("encoder_decoder") else \
            {**run.model, "units": run.model["stacks"]["encoder"]["units"]}     # the encoder's shares
        print(f"plan drawn: {draw_plan(best, drawn, run.devices, args.png)}")


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"profile-devices": profile_devices, "profile-model": profile_model_command, "search": search_command}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        usage = (f"usage: {PROG} {{profile-devices,profile-model,search}} ...\n"
                 f"  profile-devices  measure every rank's device and the link (one process per rank, like training)\n"
                 f"  profile-model    measure the model's parameters, activations and FLOPs per sub-block\n"
                 f"  search           find the fastest plan that fits and write its config\n"
                 f"run {PROG} COMMAND --help for a command's options")
        if argv and argv[0] in ("-h", "--help"):
            print(usage)
            return
        sys.stderr.write(f"{PROG}: error: " + (f"unknown command {argv[0]!r}; " if argv else "") +
                         "choose profile-devices, profile-model or search\n")
        sys.exit(2)
    commands[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
