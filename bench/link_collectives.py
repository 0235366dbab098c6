"""Where a shaped link's rate goes: each gloo primitive the engine uses, on both ranks, with the
kernel's own counters for every case.

World 2 over gloo, one thread per rank. Every primitive moves `size` bytes from each rank to the
other (the step's transfers are 16 KB to 8 MB: all-MiniLM-L6-v2 at batch 8 x 128 sends 0.79 MB a
boundary collective, 1/4 of that in 4 chunks or streams):
  all_gather      dist.all_gather_into_tensor of a [size] shard (a sub-block boundary going in)
  all_to_all      dist.all_to_all_single of [2, size] blocks
  reduce_scatter  an all-to-all of the blocks and a local sum (Galaxy's reduce-scatter on gloo
                  before pair_exchange; a boundary going out)
  all_reduce      dist.all_reduce of [size] (gloo's ring: each rank sends size bytes)
  exchange        a paired isend / irecv of [size] (dist.batch_isend_irecv: send posted first)
  paired_all_gather, paired_reduce_scatter   Galaxy's two-rank path (galaxy.distributed.
                  pair_exchange): the receive posted before the send
  one_way         rank 0 sends [size], rank 1 answers with one element: the link's rate one way
Modes:
  alone    barrier, --gap_ms idle, one call; --reps times
  step     --calls calls back to back, each after --compute_ms of GEMMs, waits blocking (what the
           layers do with comm_chunks 1)
  overlap  --calls times: start the call, compute half its nominal link time, wait
Rates are payload Mbit/s into each rank: size * 8 over the time from the later rank's call to the
end of this rank's wait (both ranks read one host clock), median over calls; "% link" is the
slower direction against the rate of the tbf on the device's eth0 (galaxy.edge).

Under each case, summed over its calls, per rank: TCP retransmitted segments, timeouts (RTO),
tail-loss probes, the tbf's drops on the device's end and on the host's end (entered through pid
1's network namespace), the device cgroup's CFS throttling, softirq time on the device's CPUs (and
per MB through its eth0, either way), the mean skb eth0 sent and received (galaxy.edge.probe.
interface_counts: tens of KB where TCP's segments cross the tbfs whole, 1.5 KB where one cut them), and
`ss -ti` of the gloo connection that carried the bytes (cwnd, smoothed RTT, time limited by the
receive window or the send buffer, BBR's bandwidth estimate).

--tcp CC ... (testbed only, it sets sysctls in the device's own namespace): rerun every case with
each congestion control in turn, a fresh gloo group (fresh connections) for each.

    flock /work/testbed.lock timeout 600 python -m galaxy.edge run --cluster clusters/two_equal_300m.json -- \\
        .venv/bin/python bench/link_collectives.py [--sizes 16 64 256 800 2048 8192] [--modes alone step overlap]
        [--primitives ...] [--tcp bbr cubic] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from two_ranks import add_rank_args, run_two  # noqa: E402
from galaxy.distributed import pair_exchange  # noqa: E402
from galaxy.edge.probe import interface_counts  # noqa: E402

PRIMITIVES = ("all_gather", "all_to_all", "reduce_scatter", "all_reduce", "exchange", "paired_all_gather",
              "paired_reduce_scatter", "one_way")
MODES = ("alone", "step", "overlap")


class Started:
    """A started call: wait() blocks until it is done on this rank."""

    def __init__(self, works, finish=None):
        self.works, self.finish = works, finish

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        if self.finish is not None:
            self.finish()


def starter(name: str, numel: int, rank: int, pg):
    """A function that starts one call of primitive `name`, each rank sending numel floats."""
    x, got = torch.randn(numel), torch.empty(numel)
    peer = dist.get_global_rank(pg, 1 - rank)
    if name == "all_gather":
        out = torch.empty(2 * numel)
        return lambda: Started([dist.all_gather_into_tensor(out, x, group=pg, async_op=True)])
    if name == "paired_all_gather":
        out = torch.empty(2 * numel)
        return lambda: Started([pair_exchange.start_all_gather(out, x, pg)])
    if name in ("all_to_all", "reduce_scatter", "paired_reduce_scatter"):
        blocks, recv = torch.randn(2, numel), torch.empty(2, numel)
        if name == "all_to_all":
            return lambda: Started([dist.all_to_all_single(recv, blocks, group=pg, async_op=True)])
        if name == "reduce_scatter":
            return lambda: Started([dist.all_to_all_single(recv, blocks, group=pg, async_op=True)],
                                   lambda: torch.sum(recv, 0, out=got))

        def paired_reduce_scatter():
            work, finish = pair_exchange.start_reduce_scatter(got, blocks, pg)
            return Started([work], finish)
        return paired_reduce_scatter
    if name == "all_reduce":
        return lambda: Started([dist.all_reduce(x, group=pg, async_op=True)])
    if name == "exchange":
        return lambda: Started(dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peer, pg),
                                                       dist.P2POp(dist.irecv, got, peer, pg)]))
    ack = torch.zeros(1)

    def one_way():                    # rank 0's time: its send until rank 1's one-element answer
        if rank == 0:
            return Started([dist.isend(x, peer, group=pg), dist.irecv(ack, peer, group=pg)])
        return Started([dist.irecv(got, peer, group=pg)], lambda: dist.send(ack, peer, group=pg))
    return one_way


# -- the kernel's view, read in the device's own namespace -----------------------------------------

def _snmp(path: str) -> dict:
    out, lines = {}, Path(path).read_text().splitlines()
    for head, values in zip(lines[::2], lines[1::2]):
        proto = head.split(":")[0]
        for k, v in zip(head.split()[1:], values.split()[1:]):
            out[f"{proto}.{k}"] = int(v)
    return out


TCP_KEYS = {"retrans": "Tcp.RetransSegs", "rto": "TcpExt.TCPTimeouts", "tlp": "TcpExt.TCPLossProbes",
            "fast_retrans": "TcpExt.TCPFastRetrans", "out_segs": "Tcp.OutSegs"}


def _qdisc(dev: str, netns_of_pid1: bool = False) -> dict:
    cmd = (["nsenter", "-t", "1", "-n"] if netns_of_pid1 else []) + ["tc", "-s", "-j", "qdisc", "show", "dev", dev]
    try:
        q = json.loads(subprocess.run(cmd, capture_output=True, text=True, timeout=5).stdout or "[]")
    except (OSError, ValueError, subprocess.SubprocessError):
        return {}
    return next(({"drops": d["drops"], "overlimits": d["overlimits"], "rate": d["options"].get("rate")}
                 for d in q if d.get("kind") == "tbf"), {})


def _cgroup_cpu_stat() -> dict:
    f = None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(",") or (not controllers and f is None):     # v1 cpu, or v2
            f = Path(f"/sys/fs/cgroup/{controllers}{path}/cpu.stat".replace("//", "/"))
    if f is None:
        return {}
    try:
        s = dict(line.split() for line in f.read_text().splitlines())
    except OSError:
        return {}
    usec = int(s.get("throttled_usec", int(s.get("throttled_time", 0)) // 1000))
    return {"throttled": int(s.get("nr_throttled", 0)), "throttled_ms": usec / 1e3}


def _softirq_ms() -> float:
    cpus = os.sched_getaffinity(0)
    total = 0
    for line in Path("/proc/stat").read_text().splitlines():
        m = re.match(r"cpu(\d+) ", line)
        if m and int(m.group(1)) in cpus:
            total += int(line.split()[7])
    return total * 1000 / os.sysconf("SC_CLK_TCK")


SS_FIELDS = ("cwnd", "rtt", "bytes_sent", "bytes_retrans", "busy", "rwnd_limited", "sndbuf_limited", "bw",
             "delivery_rate", "pacing_rate", "ssthresh")


def _connections() -> dict:
    """{(local, peer): {field: value}} of this namespace's established TCP connections (ss -ti)."""
    try:
        text = subprocess.run(["ss", "-tinH", "state", "established"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    out, key = {}, None
    for line in text.splitlines():
        if not line.startswith((" ", "\t")):
            parts = line.split()
            key = (parts[-2], parts[-1]) if len(parts) >= 2 else None
            continue
        if key is None:
            continue
        info = {}
        for k, v in re.findall(r"([a-z_]+)[:(]([0-9.]+[A-Za-z/]*)", line):
            if k in SS_FIELDS:
                info[k] = v
        out[key] = info
    return out


def _num(v) -> float:
    m = re.match(r"([0-9.]+)(\w*)", str(v))
    if not m:
        return 0.0
    scale = {"ms": 1, "Kbps": 1e-3, "Mbps": 1, "Gbps": 1e3, "bps": 1e-6}.get(m.group(2).split("/")[0], 1)
    return float(m.group(1)) * scale


def snapshot(iface: str, host_end: str | None) -> dict:
    counters = {**_snmp("/proc/net/snmp"), **_snmp("/proc/net/netstat")}
    s = {k: counters.get(key, 0) for k, key in TCP_KEYS.items()}
    s["tbf_drops"] = _qdisc(iface).get("drops", 0)
    s["host_tbf_drops"] = _qdisc(host_end, True).get("drops", 0) if host_end else 0
    s.update(interface_counts(iface))       # the mean skb each way (galaxy.edge.probe)
    s.update(_cgroup_cpu_stat())
    s["softirq_ms"] = _softirq_ms()
    s["conns"] = _connections()
    return s


def difference(a: dict, b: dict) -> dict:
    """Counters from snapshot a to b, and the busiest connection's state at b."""
    out = {k: round(b[k] - a[k], 3) for k in b if k != "conns" and isinstance(b[k], (int, float))}
    sent = {k: _num(v.get("bytes_sent", 0)) - _num(a["conns"].get(k, {}).get("bytes_sent", 0))
            for k, v in b["conns"].items()}
    if sent:
        key = max(sent, key=sent.get)
        c, c0 = b["conns"][key], a["conns"].get(key, {})
        out.update({"cwnd": c.get("cwnd"), "srtt_ms": c.get("rtt", "").split("/")[0] or None,
                    "bbr_bw": c.get("bw"), "ssthresh": c.get("ssthresh"),
                    **{f"{k}_ms": _num(c.get(k, 0)) - _num(c0.get(k, 0)) for k in ("busy", "rwnd_limited", "sndbuf_limited")}})
    return out


# -- the cases ----------------------------------------------------------------------------------------

def gemm_per_ms() -> float:
    """256 x 256 GEMMs this device runs per ms (one thread, its CPU share), over 0.3 s."""
    a = torch.randn(256, 256)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 0.3:
        a @ a
        n += 1
    return n / ((time.perf_counter() - t0) * 1e3)


def compute(gemms: int, a=torch.randn(256, 256)) -> None:
    for _ in range(gemms):
        a @ a


def now() -> float:
    """CLOCK_MONOTONIC: one clock for every namespace of the host, so the ranks' times compare."""
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def run_case(start, mode: str, args, nominal_ms: float, per_ms: float) -> list[tuple[float, float]]:
    """(call, end of wait) on this rank for every call in `mode`."""
    spans = []
    if mode == "alone":
        for _ in range(args.reps):
            dist.barrier()
            time.sleep(args.gap_ms / 1e3)
            t0 = now()
            start().wait()
            spans.append((t0, now()))
        return spans
    gemms = int(per_ms * (args.compute_ms if mode == "step" else max(1.0, nominal_ms / 2)))
    dist.barrier()
    for _ in range(args.calls):
        if mode == "step":
            compute(gemms)
            t0 = now()
            start().wait()
        else:
            t0 = now()
            pending = start()
            compute(gemms)
            pending.wait()
        spans.append((t0, now()))
    return spans


def set_congestion_control(cc: str) -> None:
    """This namespace's default for new connections. Outside the host's own namespace the kernel
    takes only those in net.ipv4.tcp_allowed_congestion_control (set on the host)."""
    try:
        Path("/proc/sys/net/ipv4/tcp_congestion_control").write_text(cc)
    except PermissionError:
        raise SystemExit(f"link_collectives.py: --tcp {cc}: not allowed in a device's namespace; on the host: "
                         f"sysctl -w net.ipv4.tcp_allowed_congestion_control=\"$(sysctl -n "
                         f"net.ipv4.tcp_allowed_congestion_control) {cc}\"") from None


def worker(rank: int, args, init_method: str, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    iface = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    host_end = _host_end(rank) if args.rank is not None else None
    link = _qdisc(iface).get("rate")
    link_mbit = link * 8 / 1e6 if link else None
    per_ms = gemm_per_ms()
    ccs = args.tcp or [Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()]
    if rank == 0:
        print_header(link_mbit, per_ms)
    rows = []
    for cc in ccs:
        if args.tcp:
            set_congestion_control(cc)
        dist.barrier()
        pg = dist.new_group([0, 1])          # fresh gloo pairs: connections made under cc
        for name in args.primitives:
            for kb in args.sizes:
                numel = kb * 1024 // 4
                start = starter(name, numel, rank, pg)
                start().wait()               # warm: buffers allocated, the connection has carried this size
                nominal_ms = numel * 4 * 8 / (link_mbit or 1e5) / 1e3
                for mode in args.modes:
                    before = snapshot(iface, host_end)
                    spans = run_case(start, mode, args, nominal_ms, per_ms)
                    mine = {"cc": cc, "primitive": name, "kb": kb, "mode": mode, "spans": spans,
                            "counters": difference(before, snapshot(iface, host_end))}
                    both = [None, None]
                    dist.all_gather_object(both, mine)
                    if rank == 0:
                        rows.append(report_row(*both, link_mbit))
                        write_json(args, link_mbit, per_ms, rows)
        dist.destroy_process_group(pg)
    if rank == 0:
        results.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def _host_end(rank: int) -> str | None:
    """The host end of this device's veth (galaxy.edge.network: <run>-h<index>), from the namespace's name."""
    name = subprocess.run(["ip", "netns", "identify"], capture_output=True, text=True).stdout.strip()
    return f"{name.rsplit('-', 1)[0]}-h{rank}" if name else None


def print_header(link_mbit, per_ms: float) -> None:
    print(f"link (tbf on eth0): {link_mbit:.0f} Mbit/s" if link_mbit else "link: not shaped", f"; {per_ms:.1f} GEMMs/ms")
    print(f"{'cc':>5} {'primitive':>14} {'KB':>5} {'mode':>7} | {'Mbit/s into r0 / r1':>19} {'% link':>6} | "
          f"{'retr':>5} {'rto':>3} {'tlp':>4} {'drops d/h':>9} {'thr ms':>7} {'sirq ms':>7} {'sirq/MB':>9} {'skb out B':>11} {'skb in B':>11} | {'cwnd':>7} {'srtt':>11} "
          f"{'rwnd; sndbuf lim ms':>18}  (r0/r1)", flush=True)


def report_row(r0: dict, r1: dict, link) -> dict:
    """One case of both ranks: printed, and returned for the JSON."""
    kb = r0["kb"]
    # A call's transfer into rank r: from the later rank's call to the end of r's wait (one
    # clock on one host), so a rank that called first is not charged for waiting on its peer.
    seconds = [statistics.median(e - max(a0, a1) for (a0, _), (a1, _), (_, e) in zip(r0["spans"], r1["spans"], r["spans"]))
               for r in (r0, r1)]
    rates = [kb * 1024 * 8 / s / 1e6 for s in seconds]
    if r0["primitive"] == "one_way":
        rates[0] = float("nan")             # rank 0 receives one element: its figure is rank 1's
    share = 100 * min(r for r in rates if r == r) / link if link else float("nan")
    c0, c1 = r0["counters"], r1["counters"]

    def pair(k, fmt="{:.0f}"):
        return "/".join(fmt.format(c.get(k) or 0) if c.get(k) is None or isinstance(c.get(k), (int, float))
                        else str(c.get(k)) for c in (c0, c1))
    drops = f"{c0.get('tbf_drops', 0) + c1.get('tbf_drops', 0)}/{c0.get('host_tbf_drops', 0) + c1.get('host_tbf_drops', 0)}"
    for c in (c0, c1):
        # softirq per MB through this device's link, either way; the mean skb each way
        mb = (c.get("tx_bytes", 0) + c.get("rx_bytes", 0)) / 1e6
        c["sirq_per_mb"] = c.get("softirq_ms", 0) / mb if mb else float("nan")
        c["skb_out"] = c.get("tx_bytes", 0) / max(1, c.get("tx_skbs", 0))
        c["skb_in"] = c.get("rx_bytes", 0) / max(1, c.get("rx_skbs", 0))
    print(f"{r0['cc']:>5} {r0['primitive']:>14} {kb:>5} {r0['mode']:>7} | {rates[0]:>9.0f} / {rates[1]:<7.0f} "
          f"{share:>6.0f} | {pair('retrans'):>5} {pair('rto'):>3} {pair('tlp'):>4} {drops:>9} "
          f"{pair('throttled_ms'):>7} {pair('softirq_ms'):>7} {pair('sirq_per_mb', '{:.1f}'):>9} "
          f"{pair('skb_out'):>11} {pair('skb_in'):>11} | {pair('cwnd', '{}'):>7} {pair('srtt_ms', '{}'):>11} "
          f"{pair('rwnd_limited_ms')}; {pair('sndbuf_limited_ms')}", flush=True)
    return {**{k: r0[k] for k in ("cc", "primitive", "kb", "mode")}, "mbit_into": rates, "seconds": seconds,
            "share_of_link": share, "rank0": r0, "rank1": r1}


def write_json(args, link_mbit, per_ms: float, rows: list) -> None:
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "link_mbit": link_mbit, "gemm_per_ms": per_ms,
                                               "rows": rows}, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--primitives", nargs="+", default=list(PRIMITIVES), choices=PRIMITIVES)
    p.add_argument("--sizes", nargs="+", type=int, default=[16, 64, 256, 800, 2048, 8192], help="KB each rank sends")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--reps", type=int, default=5, help="calls per case in mode alone")
    p.add_argument("--calls", type=int, default=8, help="calls per case in modes step and overlap")
    p.add_argument("--gap_ms", type=float, default=50.0, help="idle before each call in mode alone")
    p.add_argument("--compute_ms", type=float, default=20.0, help="GEMMs before each call in mode step")
    p.add_argument("--tcp", nargs="+", default=None,
                   help="congestion controls to compare (testbed only: sets the device namespace's sysctl)")
    p.add_argument("--json", default=None)
    add_rank_args(p)
    args = p.parse_args()
    if args.tcp and args.rank is None:
        raise SystemExit("link_collectives.py: --tcp sets a namespace's sysctl: run it inside the testbed (galaxy.edge run)")
    run_two(worker, args)          # rank 0 prints every case as it ends, and writes --json


if __name__ == "__main__":
    main()
