"""The testbed's network: a bridge, and per device a network namespace joined to it by a veth pair.

    host:    bridge gxe-1a2b3c-br  <-- veth gxe-1a2b3c-h0 ... gxe-1a2b3c-hN (each shaped, host end)
    device i: namespace gxe-1a2b3c-i, its end of the pair named eth0 (shaped), address .(i+1)/24

The host itself has no address on the bridge: the devices reach one another and nothing else.
Every name starts with the run's name (galaxy.edge.runs), which `clean` looks for.
"""
from __future__ import annotations

import ipaddress
import json
import random

from galaxy.edge.cluster import Device
from galaxy.edge.shaping import gso_bytes, shape, shape_commands
from galaxy.edge.shell import EdgeError, run

DEVICE_IF = "eth0"          # a device's interface, inside its namespace
# Subnets the testbed picks from: 10.160.0.0 - 10.249.255.0 /24, clear of the ranges container
# tools and home routers hand out first (10.0.x, 10.1.x, 172.17.x, 192.168.x).
FIRST_OCTETS = range(160, 250)


def bridge_name(run_name: str) -> str:
    return f"{run_name}-br"


def host_end(run_name: str, index: int) -> str:
    return f"{run_name}-h{index}"


def netns_name(run_name: str, index: int) -> str:
    return f"{run_name}-{index}"


def device_address(subnet: ipaddress.IPv4Network, index: int) -> ipaddress.IPv4Address:
    return subnet.network_address + index + 1


def host_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network the host has an address in or a route to (default routes aside)."""
    found = []
    for argv in (("ip", "-j", "addr"), ("ip", "-j", "route", "show", "table", "all")):
        try:
            entries = json.loads(run(*argv) or "[]")
        except (EdgeError, ValueError):
            continue
        for entry in entries:
            prefixes = [f"{a['local']}/{a.get('prefixlen', 32)}" for a in entry.get("addr_info", [])
                        if a.get("family") == "inet"]
            if entry.get("dst") not in (None, "default"):
                prefixes.append(entry["dst"])
            for prefix in prefixes:
                try:
                    network = ipaddress.ip_network(prefix, strict=False)
                except ValueError:
                    continue
                if network.version == 4:
                    found.append(network)
    return found


def pick_subnet(taken: list[ipaddress.IPv4Network], rng: random.Random | None = None) -> ipaddress.IPv4Network:
    """A /24 that overlaps none of `taken` (the host's networks and other live testbeds')."""
    rng = rng or random.Random()
    for _ in range(200):
        candidate = ipaddress.ip_network(f"10.{rng.choice(FIRST_OCTETS)}.{rng.randrange(256)}.0/24")
        if not any(candidate.overlaps(t) for t in taken):
            return candidate
    raise EdgeError("found no free /24 in 10.160.0.0-10.249.255.0 for the testbed; the host's routes "
                    "cover them all")


class Network:
    """Builds one run's bridge, namespaces and links; up() records what it made in `made`, so that
    a teardown after a failure halfway removes exactly that (galaxy.edge.clean.remove)."""

    def __init__(self, run_name: str, devices: tuple[Device, ...], subnet: ipaddress.IPv4Network):
        self.run_name, self.devices, self.subnet = run_name, devices, subnet
        self.made: list[tuple[str, str]] = []       # ("bridge" | "link" | "netns", name), in order

    def address(self, index: int) -> ipaddress.IPv4Address:
        return device_address(self.subnet, index)

    def up(self) -> None:
        gso = gso_bytes(d.link_mbit for d in self.devices)
        bridge = bridge_name(self.run_name)
        run("ip", "link", "add", bridge, "type", "bridge")
        self.made.append(("bridge", bridge))
        run("ip", "link", "set", bridge, "up")
        for i, device in enumerate(self.devices):
            ns, end = netns_name(self.run_name, i), host_end(self.run_name, i)
            run("ip", "netns", "add", ns)
            self.made.append(("netns", ns))
            run("ip", "link", "add", end, "type", "veth", "peer", "name", DEVICE_IF, "netns", ns)
            self.made.append(("link", end))
            run("ip", "link", "set", end, "master", bridge, "up")
            run("ip", "-n", ns, "link", "set", "lo", "up")
            run("ip", "-n", ns, "addr", "add", f"{self.address(i)}/{self.subnet.prefixlen}", "dev", DEVICE_IF)
            if gso is not None:     # the skbs this device's TCP builds pass every tbf whole (shaping.py)
                run("ip", "-n", ns, "link", "set", DEVICE_IF, "gso_max_size", str(gso))
            run("ip", "-n", ns, "link", "set", DEVICE_IF, "up")
            shape(end, None, device.link_mbit, device.latency_ms)
            shape(DEVICE_IF, ns, device.link_mbit, device.latency_ms)

    def describe(self) -> list[str]:
        """What up() builds, one line per device (for `check`)."""
        gso = gso_bytes(d.link_mbit for d in self.devices)
        lines = [f"bridge {bridge_name(self.run_name)}, subnet {self.subnet} (the host gets no address on it)"
                 + (f"; every {DEVICE_IF} gso_max_size {gso}" if gso else "")]
        for i, d in enumerate(self.devices):
            commands = shape_commands(host_end(self.run_name, i), None, d.link_mbit, d.latency_ms)
            tbf = commands[-1][commands[-1].index("tbf"):]
            lines.append(f"{d.name}: namespace {netns_name(self.run_name, i)}, {DEVICE_IF} {self.address(i)}, "
                         f"veth {host_end(self.run_name, i)} on the bridge; both ends: {' '.join(tbf)}"
                         + (f", netem delay {d.latency_ms:g}ms" if d.latency_ms else ""))
        return lines
