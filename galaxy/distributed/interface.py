"""Which network interface a rank's collectives use when its peers are on other machines.

gloo picks the address it offers its peers from the host name, which most machines resolve to
127.0.0.1 (Debian maps it to 127.0.1.1): the peers then dial their own loopback and the ranks
never connect. Tried in two network namespaces, rank 0 waited 5 minutes past a 60 s timeout_s
(docs/edge.md). NCCL's socket bootstrap guesses in the same way. So unless the user named an
interface (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME), a rank binds to the interface the kernel
routes rank 0's address through: the network its peers share with it.

The route is the kernel's own choice: a UDP socket connect()ed to rank 0's address (no packet is
sent) reads back the local address it would use, which is matched to an interface (IPv4: the
SIOCGIFADDR ioctl on each; IPv6: /proc/net/if_inet6). Loopback (every rank on one machine) changes
nothing.
"""
from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from dataclasses import dataclass
from urllib.parse import urlparse

IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
SIOCGIFADDR = 0x8915


@dataclass(frozen=True)
class Route:
    peer: str                   # rank 0's address, as resolved
    local: str | None           # this machine's address towards it (None: no route)
    interface: str | None       # the interface that holds `local` (None: not found)

    def describe(self) -> str:
        """' via eth0 (10.0.0.2)' for an error line."""
        if self.local is None:
            return f" (this machine has no route to {self.peer})"
        return f" via interface {self.interface or '(unknown)'} ({self.local})"


def rendezvous_host(init_method: str | None) -> str | None:
    """Rank 0's host in a tcp:// init method, or MASTER_ADDR under env:// (torchrun)."""
    if not init_method:
        return None
    if init_method.startswith("env://"):
        return os.environ.get("MASTER_ADDR")
    return urlparse(init_method).hostname if init_method.startswith("tcp://") else None


def interface_of(local: str) -> str | None:
    """The interface that holds the local address `local`."""
    if ipaddress.ip_address(local).version == 6:
        packed = ipaddress.ip_address(local).packed.hex()
        try:
            with open("/proc/net/if_inet6", encoding="ascii") as f:
                for line in f:      # "fe800000000000000000000000000001 02 40 20 80 eth0"
                    fields = line.split()
                    if len(fields) == 6 and fields[0] == packed:
                        return fields[5]
        except OSError:
            return None
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue            # an interface without an IPv4 address
            if socket.inet_ntoa(raw[20:24]) == local:
                return name
    return None


def route_to(host: str, port: int = 9) -> Route:
    """How this machine reaches `host`: the local address and interface the kernel would use."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    except OSError:
        return Route(host, None, None)
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect(address)          # UDP: picks the route, sends nothing
            local = s.getsockname()[0]
        except OSError:
            return Route(address[0], None, None)
    if ipaddress.ip_address(local).is_loopback:
        return Route(address[0], local, "lo")
    return Route(address[0], local, interface_of(local))


def bind_to_rendezvous(init_method: str | None) -> str:
    """Point gloo and NCCL at the interface towards rank 0 unless the user named one.
    Returns the text an error about the rendezvous adds (' via interface eth0 (10.0.0.2)'), ''
    for a single process, a loopback rendezvous or interfaces the user chose."""
    host = rendezvous_host(init_method)
    if host is None or any(os.environ.get(v) for v in IFNAME_VARIABLES):
        return ""
    route = route_to(host)
    if route.local is not None and ipaddress.ip_address(route.local).is_loopback:
        return ""
    if route.interface is not None:
        for variable in IFNAME_VARIABLES:
            os.environ[variable] = route.interface
    return route.describe()
