"""Device, link and cluster profiles: JSON files a user keeps, reads and edits.

A cluster description ("galaxy-devices", what `plan.py profile-devices` writes and `plan.py search
--devices` reads) is one device entry per rank, in rank order, plus the link between them:

    {"format": "galaxy-devices", "version": 1,
     "devices": [DEVICE, ...],                   # rank 0, rank 1, ...
     "link": LINK | null}                        # null: one device, or profiled alone

    DEVICE = {"name": str, "host": str, "device": "cpu" | "cuda", "threads": int,
              "memory_mib": float,               # what a rank may use (CPU: MemAvailable / ranks on the host)
              "baseline_mib": float,             # a training process before its model (CPU RSS; 0 on CUDA)
              "gemm_flops_per_s": float,         # matmul rate at the model's largest GEMM
              "decode_flops_per_s": float | absent,  # the same product on one token (decode steps)
              "optimizer_s_per_param": {"adamw": float, "sgd": float},
              "optimizer_fused": bool | absent,  # torch's fused step (no temporaries); absent: false
              "grad_accumulate_s_per_param": float | absent,  # adding a micro-batch's gradient into .grad
              "freed_memory_kept": bool | absent,  # CPU heap keeps freed memory (cpu_allocator keep)
              "compute": COMPUTE | absent}       # measured sub-block times (absent: FLOPs / gemm rate)

    COMPUTE = {"model": {shape keys it was measured at}, "rows": [r, ...],
               "kinds": {kind: {"units": [u, ...], "fwd_s": [[s per row] per unit], "bwd_s": [[...]]}}}
    kinds: att_tp (units: query heads), att_sp, mlp_sp, con, head (units: tokens), mlp_tp (MLP
    columns), embed (units: the full sequence); times are seconds of one sub-block's forward /
    backward on `rows` rows, interpolated linearly in both units and rows. A profile taken with a
    PEFT method in the config also holds COMPUTE["peft"] = {"signature": {...}, "rows", "kinds"}:
    the same grid as the method runs it (galaxy.planner.method; side-tuning adds the kind side,
    units: tokens); absent, the method is timed by the full fine-tuning table.

    LINK = {"backend": str, "world": int,
            "fit": {kind: {"latency_s": float, "bytes_per_s": float}},   # all_gather, reduce_scatter,
            "measured": [{"kind", "group", "bytes", "uneven", "seconds"}],  # all_reduce, send_recv
            "pairs": [PAIR, ...] | absent}       # every pair of ranks, on more than two ranks

    PAIR = {"ranks": [a, b], "latency_s": float, "bytes_per_s": float,   # a send from a to b
            "measured": [{"bytes", "seconds"}]}

What the link costs a plan: galaxy.planner.link_model.

A device file may also be a single DEVICE object, and a link file a bare LINK (or a cluster, whose
link is taken): `compose` joins devices profiled alone and a link measured between two of them
into one cluster description (a user with three different boxes cannot always run them together).
"""
from __future__ import annotations

import json
import math
import os

FORMAT, VERSION = "galaxy-devices", 1
LINK_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "send_recv")
COMPUTE_KINDS = ("att_tp", "att_sp", "mlp_tp", "mlp_sp", "con", "embed", "head", "side")


class ProfileError(ValueError):
    """A profile file that cannot be used; the message is one line naming the file and the key."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).splitlines()))


def ring_steps(kind: str, n: int) -> int:
    """Rounds of the ring algorithm: what the per-call latency is multiplied by."""
    if kind == "send_recv":
        return 1
    if n <= 1:
        return 0
    return 2 * (n - 1) if kind == "all_reduce" else n - 1


def fit_link(measured: list[dict]) -> dict:
    """Least-squares latency and bandwidth per kind from timed collectives (relative errors
    weighted alike: each point's equation is divided by its time). Both stay positive."""
    fit = {}
    for kind in LINK_KINDS:
        points = [m for m in measured if m["kind"] == kind and m["seconds"] > 0]
        if not points:
            continue
        # t = a * steps + b * bytes, weighted by 1 / t
        rows = [(ring_steps(kind, m["group"]) / m["seconds"], m["bytes"] / m["seconds"]) for m in points]
        saa = sum(a * a for a, _ in rows)
        sbb = sum(b * b for _, b in rows)
        sab = sum(a * b for a, b in rows)
        sa, sb = sum(a for a, _ in rows), sum(b for _, b in rows)
        det = saa * sbb - sab * sab
        a = b = None
        if det > 1e-12 * max(saa * sbb, 1e-300):
            a = (sa * sbb - sb * sab) / det
            b = (sb * saa - sa * sab) / det
        if a is None or a <= 0 or b is None or b <= 0:      # one parameter only: keep the other tiny
            small = min(points, key=lambda m: m["bytes"])
            big = max(points, key=lambda m: m["bytes"])
            a = max(small["seconds"] / max(ring_steps(kind, small["group"]), 1), 1e-9)
            rest = big["seconds"] - a * ring_steps(kind, big["group"])
            b = max(rest, 1e-12) / max(big["bytes"], 1)
        fit[kind] = {"latency_s": a, "bytes_per_s": 1.0 / b}
    return fit


# --- reading and checking ----------------------------------------------------------------------

def _number(where: str, obj: dict, key: str, positive: bool = True, required: bool = True):
    value = obj.get(key)
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or (value <= 0 if positive else value < 0):
        need = "a positive number" if positive else "a number, 0 or more"
        raise ProfileError(f"{where}: '{key}' must be {need}, got {json.dumps(value)}")
    return float(value)


def check_device(device, where: str) -> dict:
    """A DEVICE entry with its defaults filled in; ProfileError names the bad key."""
    if not isinstance(device, dict):
        raise ProfileError(f"{where} must be a JSON object, got {json.dumps(device)[:40]}")
    out = dict(device)
    out.setdefault("name", where)
    out.setdefault("device", "cpu")
    _number(where, out, "memory_mib")
    out["baseline_mib"] = _number(where, out, "baseline_mib", positive=False, required=False) or 0.0
    compute = out.get("compute")
    if compute is None:
        _number(where, out, "gemm_flops_per_s")    # the only way to time compute without tables
    else:
        _number(where, out, "gemm_flops_per_s", required=False)
        _check_compute(compute, f"{where} compute")
    opt = out.get("optimizer_s_per_param") or {}
    if not isinstance(opt, dict):
        raise ProfileError(f"{where}: 'optimizer_s_per_param' must be an object like {{\"adamw\": 3e-9}}")
    for name in opt:
        _number(f"{where} optimizer_s_per_param", opt, name, positive=False)
    out["optimizer_s_per_param"] = dict(opt)
    _number(where, out, "decode_flops_per_s", required=False)
    out["grad_accumulate_s_per_param"] = _number(where, out, "grad_accumulate_s_per_param", positive=False,
                                                 required=False) or 0.0
    for flag in ("optimizer_fused", "freed_memory_kept"):
        if not isinstance(out.get(flag, False), bool):
            raise ProfileError(f"{where}: '{flag}' must be true or false")
    return out


def _check_compute(compute, where: str) -> None:
    _check_table(compute, where)
    if compute.get("peft") is not None:
        _check_table(compute["peft"], f"{where} peft")
        if not isinstance(compute["peft"].get("signature"), dict):
            raise ProfileError(f"{where} peft: 'signature' must be an object naming the method")


def _check_table(compute, where: str) -> None:
    if not isinstance(compute, dict) or not isinstance(compute.get("kinds"), dict):
        raise ProfileError(f"{where} must hold 'rows' and 'kinds'")
    rows = compute.get("rows")
    if not isinstance(rows, list) or not rows or any(not isinstance(r, int) or r < 1 for r in rows) \
            or rows != sorted(set(rows)):
        raise ProfileError(f"{where}: 'rows' must be increasing positive integers, got {json.dumps(rows)}")
    for kind, table in compute["kinds"].items():
        if kind not in COMPUTE_KINDS:
            raise ProfileError(f"{where}: unknown kind '{kind}'; kinds are {', '.join(COMPUTE_KINDS)}")
        units = table.get("units")
        if not isinstance(units, list) or not units or units != sorted(set(units)):
            raise ProfileError(f"{where} {kind}: 'units' must be increasing, got {json.dumps(units)}")
        for key in ("fwd_s", "bwd_s"):
            grid = table.get(key)
            if not isinstance(grid, list) or len(grid) != len(units) or \
                    any(not isinstance(row, list) or len(row) != len(rows) for row in grid):
                raise ProfileError(f"{where} {kind}: '{key}' must be {len(units)} lists of {len(rows)} "
                                   f"times (units x rows)")


def check_link(link, where: str) -> dict:
    """A LINK with its fit filled in (a hand-written {latency_s, bytes_per_s} applies to every kind)."""
    if not isinstance(link, dict):
        raise ProfileError(f"{where} must be a JSON object")
    out = dict(link)
    if "fit" not in out:
        if "latency_s" in out or "bytes_per_s" in out:
            one = {"latency_s": _number(where, out, "latency_s", positive=False),
                   "bytes_per_s": _number(where, out, "bytes_per_s")}
            out["fit"] = {kind: dict(one) for kind in LINK_KINDS}
        elif out.get("measured"):
            out["fit"] = fit_link(out["measured"])
        else:
            raise ProfileError(f"{where} needs 'fit' (per collective kind), 'measured' timings, or "
                               f"'latency_s' and 'bytes_per_s'")
    fit = out["fit"]
    for kind in LINK_KINDS:
        if kind not in fit:
            if "all_gather" in fit and kind == "send_recv":
                fit[kind] = dict(fit["all_gather"])
                continue
            raise ProfileError(f"{where} fit has no '{kind}'")
        _number(f"{where} fit {kind}", fit[kind], "latency_s", positive=False)
        _number(f"{where} fit {kind}", fit[kind], "bytes_per_s")
    for i, pair in enumerate(out.get("pairs") or ()):
        _check_pair(pair, f"{where} pairs[{i}]")
    return out


def _check_pair(pair, where: str) -> None:
    ranks = pair.get("ranks") if isinstance(pair, dict) else None
    if not isinstance(ranks, list) or len(ranks) != 2 or len(set(ranks)) != 2 or \
            any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in ranks):
        raise ProfileError(f"{where}: 'ranks' must be two different ranks like [0, 2]")
    _number(where, pair, "latency_s", positive=False)
    _number(where, pair, "bytes_per_s")


def fit_pair(a: int, b: int, measured: list[dict]) -> dict:
    """A PAIR entry from sends timed between ranks a and b ([{"bytes", "seconds"}])."""
    fit = fit_link([{"kind": "send_recv", "group": 2, **m} for m in measured])["send_recv"]
    return {"ranks": [a, b], **fit, "measured": measured}


def read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise ProfileError(f"{path!r} not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ProfileError(f"{path!r} cannot be read: {e}") from None
    except json.JSONDecodeError as e:
        raise ProfileError(f"{path!r} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None


def cluster(devices: list[dict], link: dict | None) -> dict:
    return {"format": FORMAT, "version": VERSION, "devices": devices, "link": link}


def check_cluster(doc, where: str) -> dict:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ProfileError(f"{where} is not a devices profile (format {FORMAT!r})")
    if doc.get("version") != VERSION:
        raise ProfileError(f"{where} has version {doc.get('version')!r}; this galaxy reads version {VERSION}")
    devices = doc.get("devices")
    if not isinstance(devices, list) or not devices:
        raise ProfileError(f"{where}: 'devices' must be a non-empty list, one entry per rank")
    checked = [check_device(d, f"{where} devices[{i}]") for i, d in enumerate(devices)]
    link = doc.get("link")
    link = None if link is None else check_link(link, f"{where} link")
    return cluster(checked, link)


def load_devices(path: str) -> tuple[list[dict], dict | None]:
    """(devices, link or None) of a devices file: a cluster, or one DEVICE object."""
    doc = read_json(path)
    if isinstance(doc, dict) and doc.get("format") == FORMAT:
        c = check_cluster(doc, path)
        return c["devices"], c["link"]
    return [check_device(doc, path)], None


def load_link(path: str) -> dict:
    """A link file: a bare LINK, or a cluster whose link is taken."""
    doc = read_json(path)
    if isinstance(doc, dict) and doc.get("format") == FORMAT:
        link = check_cluster(doc, path)["link"]
        if link is None:
            raise ProfileError(f"{path} holds no link (it was profiled on one rank)")
        return link
    return check_link(doc, path)


def compose(device_files: list[str], link_file: str | None = None) -> dict:
    """One cluster description from devices files (in rank order; a file may hold several ranks,
    and may be named again for a second device of the same kind) and a link. Without link_file,
    the link of the one multi-rank file given is used."""
    devices, links = [], []
    for path in device_files:
        found, link = load_devices(path)
        devices.extend(dict(d) for d in found)
        if link is not None:
            links.append(link)
    if link_file is not None:
        link = load_link(link_file)
    elif len(devices) == 1:
        link = None
    elif len(links) == 1 or (links and all(x == links[0] for x in links)):
        link = links[0]
    elif not links:
        raise ProfileError(f"{len(devices)} devices but none of {', '.join(device_files)} holds a link; "
                           f"give --link (a link file, or a devices profile taken on two ranks)")
    else:
        raise ProfileError("the devices files hold different links; choose one with --link")
    return cluster(devices, link)


def write_json(path: str, doc: dict) -> None:
    from galaxy.files import write_json_atomic
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_json_atomic(path, doc)
