"""What the host must offer before a testbed is built: root, iproute2, namespaces, qdiscs, cgroups.

Every missing piece is one line; `run` stops with all of them (exit status 2) before it creates
anything, and `check` lists them without needing root.
"""
from __future__ import annotations

import gzip
import os
import platform
import shutil

from galaxy.edge.cgroups import Layout, find_layout
from galaxy.edge.cluster import Cluster

# Kernel features: (CONFIG_ option, module name, what the testbed uses it for).
FEATURES = {
    "veth": ("CONFIG_VETH", "veth", "links between the namespaces"),
    "bridge": ("CONFIG_BRIDGE", "bridge", "the switch that joins the devices"),
    "tbf": ("CONFIG_NET_SCH_TBF", "sch_tbf", "link rates (tc tbf)"),
    "netem": ("CONFIG_NET_SCH_NETEM", "sch_netem", "latency_ms (tc netem)"),
}


def kernel_config(path: str = "/proc/config.gz") -> dict[str, str] | None:
    """The running kernel's CONFIG_ options (y or m), or None where the kernel does not publish them."""
    try:
        with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    return dict(line.split("=", 1) for line in lines if line.startswith("CONFIG_") and "=" in line)


def has_feature(name: str, config: dict[str, str] | None, release: str | None = None) -> bool | None:
    """Whether the kernel has a feature: built in or a module it can load; None when neither the
    kernel's config nor its module lists say (then the step that needs it reports its failure)."""
    option, module, _ = FEATURES[name]
    if config is not None:
        return config.get(option) in ("y", "m")
    if os.path.isdir(f"/sys/module/{module}"):
        return True
    base = f"/lib/modules/{release or platform.release()}"
    found_lists = False
    for listing in ("modules.builtin", "modules.dep"):
        try:
            with open(os.path.join(base, listing), encoding="utf-8") as f:
                text = f.read()
        except OSError:
            continue
        found_lists = True
        if f"/{module}.ko" in text:
            return True
    return False if found_lists else None


def missing(cluster: Cluster, need_root: bool = True) -> list[str]:
    """One line per thing the host lacks to run this cluster (empty: it can)."""
    problems = []
    if need_root and os.geteuid() != 0:
        problems.append("not root: the testbed makes network namespaces, links, qdiscs and cgroups; "
                        "run it as root (e.g. sudo)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            problems.append(f"no `{tool}` command: install iproute2")
    for ns in ("net", "uts"):
        if not os.path.exists(f"/proc/self/ns/{ns}"):
            problems.append(f"this kernel has no {ns} namespaces (CONFIG_{ns.upper()}_NS)")
    config = kernel_config()
    wanted = ["veth", "bridge", "tbf"] + (["netem"] if any(d.latency_ms for d in cluster.devices) else [])
    for name in wanted:
        if has_feature(name, config) is False:
            problems.append(lacking(name, cluster))
    layout = find_layout()
    if not isinstance(layout, Layout):
        problems.append(layout)
    return problems


def lacking(name: str, cluster: Cluster) -> str:
    option, _, use = FEATURES[name]
    if name == "netem":
        asking = ", ".join(d.name for d in cluster.devices if d.latency_ms)
        return (f"latency_ms (device {asking}) needs the kernel's netem qdisc, which this kernel lacks "
                f"({option}); remove latency_ms from the cluster file")
    return f"this kernel lacks {option}, needed for {use}"
