"""A device's link rate (tc tbf) and optional delay (tc netem), on one end of its veth pair.

Every device's veth is shaped on both ends, each end's egress: the host end limits what reaches
the device, the device's end what leaves it. A transfer from device a to device b passes a's end
(a's rate) and then b's host end (b's rate), so it runs at the slower of the two links, as
between two boxes on one switch.

Token bucket sizes, measured on this project's 2-core VM (8 MB TCP transfers between two
namespaces; payload rate, so headers cost 3-4%): a 64 KB bucket with a 256 KB queue gave 97 / 289
/ 873 Mbit/s at 100 / 300 / 1000; a 125 KB bucket (1 ms at 1 Gbit/s) with a 20 ms queue gave 975
at 1000. So the bucket holds 1 ms at the link's rate (at least 32 KiB: tbf must pass a whole
segment, and smaller buckets lose rate to timer slack), and the queue holds 20 ms more (a deeper
queue only adds delay; a shallower one drops and TCP backs off).

What a tbf cuts, it costs: a TSO/GSO skb (up to 64 KB of one TCP stream, which the veth passes
whole) that is larger than the bucket is cut by the tbf into wire packets, and each packet then
crosses veth, bridge, tbf and veth on its own, in softirq on the sender's core (no GRO on a veth
joins them again). At 300 Mbit/s BBR sizes its skbs to about 1 ms of its pacing rate, 37-47 KB,
just over the 37.5 KB bucket, so every skb was cut: 1.5 KB mean skbs on eth0 and 5-10 ms of
softirq per MB through the device, against 30-60 KB skbs and 0.4-1.0 ms per MB at 1 Gbit/s, whose
125 KB bucket passes them whole (bench/link_collectives.py, 2026-11-26). So every device's eth0
gets a GSO limit (`ip link set eth0 gso_max_size`) that fits the cluster's smallest bucket with a
header per segment (gso_bytes): the buckets keep 1 ms of the rate, the rate holds (tbf charges
an skb's every segment with its headers), and the skbs pass whole (a 40 MB send between two
namespaces at 300 Mbit/s: 34 KB mean skbs and 9 ticks of softirq against 1.5 KB and 55; 100
Mbit/s: 29 KB and 11 against 2 KB and 68).

What the model does not lose, measured with bench/link_collectives.py at 300 Mbit/s (docs/edge.md):
no tbf drop and no RTO in any case, 286-291 Mbit/s one way and 280-284 each way for an all-reduce
or a receive-first exchange; BBR (this VM's kernel default, which the namespaces inherit) and cubic
measured alike. The collectives that got about half the rate did so by gloo's send-before-receive
order (galaxy/distributed/pair_exchange.py), which a real link shares, so the model stays as is.
"""
from __future__ import annotations

from galaxy.edge.shell import run

MIN_BURST_BYTES = 32 * 1024
BURST_S, QUEUE_S = 0.001, 0.020
# A GSO skb's segments each carry Ethernet, IPv4 and TCP headers with timestamps (14 + 20 + 32
# bytes) around at most an MSS of payload; tbf charges the skb for all of them.
MSS, SEGMENT_HEADERS = 1448, 66
GSO_DEFAULT = 65536         # the kernel's default gso_max_size of a veth (and IPv4's ceiling)


def tbf_sizes(link_mbit: float) -> tuple[int, int]:
    """(bucket bytes, queue limit bytes) for a link of link_mbit Mbit/s."""
    bytes_per_s = link_mbit * 1e6 / 8
    burst = max(MIN_BURST_BYTES, int(bytes_per_s * BURST_S))
    return burst, burst + int(bytes_per_s * QUEUE_S)


def gso_bytes(link_mbits) -> int | None:
    """The gso_max_size for every device of a cluster whose links run at `link_mbits`: the largest
    skb of payload whose segments and headers fit the smallest bucket, so that no tbf on any path
    cuts it (None: the default 64 KB fits every bucket)."""
    burst = min(tbf_sizes(m)[0] for m in link_mbits)
    fit = burst * MSS // (MSS + SEGMENT_HEADERS)
    return fit if fit < GSO_DEFAULT else None


def netem_limit(link_mbit: float, latency_ms: float) -> int:
    """Packets netem must hold: those in flight during the delay at the link's rate (1500-byte
    packets, twice over), at least netem's default 1000, so the delay line never drops."""
    return max(1000, int(2 * link_mbit * 1e6 / 8 / 1500 * latency_ms / 1000))


def shape_commands(dev: str, netns: str | None, link_mbit: float, latency_ms: float) -> list[list[str]]:
    """The tc commands that shape `dev` (in `netns`, None: the host's) egress."""
    tc = ["tc"] if netns is None else ["tc", "-n", netns]
    burst, limit = tbf_sizes(link_mbit)
    tbf = ["tbf", "rate", f"{link_mbit:g}mbit", "burst", str(burst), "limit", str(limit)]
    if not latency_ms:
        return [[*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf]]
    # The delay line first, the rate limit as its one child (netem's own example layout).
    return [[*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay", f"{latency_ms:g}ms",
             "limit", str(netem_limit(link_mbit, latency_ms))],
            [*tc, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf]]


def shape(dev: str, netns: str | None, link_mbit: float, latency_ms: float = 0.0) -> None:
    for command in shape_commands(dev, netns, link_mbit, latency_ms):
        run(*command)
