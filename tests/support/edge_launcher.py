"""Test-side helpers of the edge testbed's tests: start `python -m galaxy.edge`, find what a run left.

Tests that build a testbed need root, network namespaces and the cpu and memory cgroup controllers;
`requires_testbed` skips them where the host lacks any of those, naming what is missing.
"""
import json
import os
import re
import subprocess
import sys

import pytest

from galaxy.edge import clean, host
from galaxy.edge.cgroups import find_layout
from galaxy.edge.cluster import Cluster, Device

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, HF_HUB_OFFLINE="1")
PYTHON = sys.executable
PROBE = [PYTHON, "-m", "galaxy.edge.probe"]      # a rank that measures its device (galaxy/edge/probe.py)
UP = re.compile(r"galaxy\.edge: testbed (gxe-[0-9a-f]{6}) up in ([0-9.]+) s")
DOWN = re.compile(r"galaxy\.edge: testbed (gxe-[0-9a-f]{6}) down in ([0-9.]+) s")

_probe = Cluster("probe", (Device("probe", 1.0, 256, 100, 1),), ())
_missing = host.missing(_probe)
requires_testbed = pytest.mark.skipif(bool(_missing), reason="the edge testbed cannot run here: " + "; ".join(_missing))


def write_cluster(path, *devices: dict) -> str:
    path.write_text(json.dumps({"devices": list(devices)}))
    return str(path)


def device(name: str, cpus: float = 1.0, memory_mib: int = 2000, link_mbit: float = 1000, **extra) -> dict:
    return {"name": name, "cpus": cpus, "memory_mib": memory_mib, "link_mbit": link_mbit, **extra}


def edge(*args: str, timeout: float = 240, **popen) -> subprocess.CompletedProcess:
    """python -m galaxy.edge ARGS, run to its end from the repository root."""
    return subprocess.run([PYTHON, "-m", "galaxy.edge", *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=timeout, **popen)


def start_edge(*args: str) -> subprocess.Popen:
    """python -m galaxy.edge ARGS in the background, its stdout and stderr merged into one pipe."""
    return subprocess.Popen([PYTHON, "-m", "galaxy.edge", *args], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def run_name(output: str) -> str:
    m = UP.search(output)
    assert m, f"no 'testbed ... up' line in:\n{output}"
    return m.group(1)


def leftovers(name: str) -> list[str]:
    """Every namespace, link, cgroup folder and state file of run `name` still on the host."""
    found = clean.find(find_layout(), [])
    left = found.get(name)
    things = (left.netns + left.links + left.cgroups) if left else []
    if os.path.exists(f"/run/galaxy-edge/{name}.json"):
        things.append(f"/run/galaxy-edge/{name}.json")
    return things
