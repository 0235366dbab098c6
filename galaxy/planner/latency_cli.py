"""plan.py search --objective latency: read the request's size, search, print, write the config
that generate.py runs, or for an encoder classifier pretrain_*.py --predict (docs/planning.md,
"Plans for generation", "Plans for one classification")."""
from __future__ import annotations

from galaxy.config import ConfigError, apply_preset, load_config
from galaxy.files import write_json_atomic
from galaxy.models.registry import family_of
from galaxy.models.shape import read_model_shape
from galaxy.planner.cli import SCRIPTS, _budgets, _check_model_matches, _notes, fail, meshes_of
from galaxy.planner.latency_devices import search_subsets, subset_lines, subset_summary
from galaxy.planner.latency_search import (DEFAULT_NEW_TOKENS, is_encoder, latency_cost_model, latency_document,
                                           latency_prediction, latency_table)
from galaxy.planner.method import config_signature
from galaxy.planner.method import describe as describe_method
from galaxy.planner.model_profile import ModelProfileError, check_model_profile
from galaxy.planner.profiles import ProfileError, compose, read_json, write_json
from galaxy.planner.table import describe, mib
from galaxy.planner.writer import write_planned_config


def request_size(args, cfg, shape: dict, encoder: bool = False) -> tuple[int, int]:
    """(N prompt tokens, M new tokens) of the request to plan for (ConfigError for a bad one); an
    encoder classifier's: (pad_size, 0), one forward of the padded input."""
    if encoder:
        return classifier_request(args, cfg)
    prompt = cfg.pad_size if args.prompt_tokens is None else args.prompt_tokens
    new = DEFAULT_NEW_TOKENS if args.new_tokens is None else args.new_tokens
    if not 1 <= prompt <= cfg.pad_size:
        raise ConfigError(f"--prompt_tokens {prompt} must be from 1 to the config's pad_size {cfg.pad_size} (a plan "
                          "that splits tokens pads every prompt to pad_size); raise pad_size for longer prompts")
    if new < 1:
        raise ConfigError(f"--new_tokens must be at least 1, got {new}")
    longest = max(prompt, cfg.pad_size) + new       # a token-splitting plan caches pad_size prompt slots
    if longest > shape["max_position_embeddings"]:
        raise ConfigError(f"--new_tokens {new} after a {max(prompt, cfg.pad_size)}-token prompt exceeds the model's "
                          f"max_position_embeddings {shape['max_position_embeddings']}; lower --new_tokens")
    return prompt, new


def classifier_request(args, cfg) -> tuple[int, int]:
    """A classifier's request: every input padded to pad_size (galaxy.inference.predict), no tokens
    generated."""
    if args.new_tokens is not None:
        raise ConfigError("--new_tokens sizes a generation request, but this model is a classifier (one forward a "
                          "request); drop --new_tokens")
    if args.prompt_tokens not in (None, cfg.pad_size):
        raise ConfigError(f"--prompt_tokens {args.prompt_tokens}: a classifier pads every input to the config's "
                          f"pad_size {cfg.pad_size}; drop --prompt_tokens and set pad_size instead")
    return cfg.pad_size, 0


def _inputs(args):
    """The config, shape, model profile, devices, budgets and cost model of a latency search."""
    cfg = apply_preset(load_config(args.config_file), "galaxy")
    shape = read_model_shape(cfg.model_path)
    if shape.get("is_encoder_decoder"):
        raise ConfigError("--objective latency plans causal LMs and encoder classifiers only so far; an "
                          "encoder-decoder's generation is not costed yet: drop --objective latency")
    model = check_model_profile(read_json(args.model), args.model)
    encoder = is_encoder(model)
    if model.get("encoder_decoder") or model.get("task") not in ("causal_lm", "classification"):
        raise ConfigError(f"--objective latency plans generation or one classification, but model profile "
                          f"{args.model} is of a {model.get('task')} model; profile a causal LM or encoder "
                          "classifier config (plan.py profile-model)")
    _check_model_matches(model, shape, cfg, args.model)
    signature = config_signature(cfg, family_of(shape["model_type"]))
    if signature["method"] in ("side", "side_only"):
        raise ConfigError("--objective latency does not cost side-tuned models (generate.py refuses them: no KV "
                          "cache; a classifier's side network is not timed); remove use_side / use_side_only")
    if args.png:
        raise ConfigError("--png draws training plans; drop it with --objective latency")
    prompt, new = request_size(args, cfg, shape, encoder)
    clus = compose(args.devices, args.link)
    devices, link = clus["devices"], clus["link"]
    budgets = _budgets(args, devices, link)
    meshes_of(args.pp, [1], len(devices), shape["num_hidden_layers"])        # checks --pp
    if any(dp != 1 for dp in args.dp or ()):
        raise ConfigError("--objective latency plans dp 1 only (replicas serve other requests, they do not shorten "
                          "one); drop --dp")
    cost = latency_cost_model(model, devices, link, prompt=prompt, new=new)
    notes = _notes(model, devices, None) + ([] if signature["method"] == "full" else [
        f"note: {describe_method(signature)} costed as the base model (its own products are not counted)"])
    return shape, model, devices, budgets, cost, notes


def no_fit_line(result, devices, prompt: int, new: int) -> str:
    lean = result.leanest
    if lean is None:
        return "no plan can be formed for this world (check the devices and --pp)"
    short = lean.shortfall(result.budgets)
    parts = [f"rank {r} ({devices[r].get('name', 'device')}) needs {mib(lean.memory_mib[r])} MiB, its budget is "
             f"{mib(result.budgets[r])} MiB: short by {mib(s)} MiB" for r, s in enumerate(short) if s > 0]
    request = f"a {prompt}-token prompt and {new} new tokens" if new else f"one {prompt}-token classification"
    return (f"no plan fits the memory budgets for {request}; under the leanest "
            f"plan (pp x dp x g {describe(lean.plan)['mesh']}) " + "; ".join(parts[:4]) +
            "; raise --memory_mib, lower --new_tokens or --prompt_tokens, or add devices")


def latency_search_command(args) -> None:
    try:
        shape, model, devices, budgets, cost, notes = _inputs(args)
        found = search_subsets(model, devices, cost.link, budgets, prompt=cost.prompt, new=cost.new, top=args.top,
                               pps=args.pp, every_device=args.all_devices)
    except (ConfigError, ProfileError, ModelProfileError, FileNotFoundError) as e:
        fail("search", e)
    ranks, result, _ = found[0]
    if not result.ranked:       # none fits anywhere: what the whole world lacks
        ranks, result, _ = next(f for f in found if len(f[0]) == len(devices))
    layers, total = shape["num_hidden_layers"], model["params"]["total"]
    used = {"device_ranks": list(ranks), "subsets": subset_summary(found)}
    if args.json:
        write_json(args.json, {**latency_document(result, layers, total, cost.prompt, cost.new), **used})
    if not result.ranked:
        fail("search", no_fit_line(result, devices, cost.prompt, cost.new))
    for line in notes:
        print(line)
    print(f"searched {sum(f[1].tried for f in found):,} plans on {len(found)} subsets of the devices in "
          f"{sum(f[1].seconds for f in found):.1f} s: world {len(devices)}, {layers} layers, memory budgets (MiB) "
          f"{', '.join(mib(b) for b in budgets)}" + (f" ({args.headroom:g}% headroom kept)" if args.headroom else ""))
    if len(found) > 1:
        print("\n".join(subset_lines(found, devices)))
    print(latency_table(result.ranked, cost.prompt, cost.new))
    _write(args, shape, result.ranked[0], [budgets[r] for r in ranks], total, cost, used, devices)


def _write(args, shape, best, budgets, total, cost, used, devices) -> None:
    """The chosen plan's config, run on the devices `used` names (generate.py --world k)."""
    try:
        doc = write_planned_config(args.config_file, best, args.out, shape=shape, budgets=budgets, trainable=total)
    except ConfigError as e:     # a plan the engine refuses is a planner bug: say so, loudly
        fail("search", f"the written config fails galaxy.config's checks (a planner bug): {e}", 1)
    doc["_planned"].update(objective="latency", task="classification" if not cost.new else "causal_lm",
                           prompt_tokens=cost.prompt, new_tokens=cost.new,
                           device_ranks=used["device_ranks"], **latency_prediction(best))
    write_json_atomic(args.out, doc)
    world, ranks = len(used["device_ranks"]), used["device_ranks"]
    command = f"python {SCRIPTS['classification']} --config_file {args.out}" if not cost.new else \
        f"python generate.py --config_file {args.out} --max_new_tokens {cost.new}"
    command += (f" --world {world} --rank R" if world > 1 else "") + \
        (" --prompt TEXT" if cost.new else " --predict FILE --out FILE.jsonl")
    where = "" if world == len(devices) else \
        f" on devices {', '.join(str(r) for r in ranks)} of {len(devices)} (rank R: the R-th of them; the others are left out)"
    print(f"wrote {args.out}" + (f" and {args.json}" if args.json else "") +
          f"; {'generate' if cost.new else 'classify'} with: {command}{where}")
