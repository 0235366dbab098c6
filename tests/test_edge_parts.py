"""The edge testbed's parts that need no testbed: cgroup figures (v1 and v2, on made-up hosts), the
interface a rank binds to, the prefixed output, token bucket sizes, run names and subnets, and the
trainer's peak memory from the cgroup."""
import io
import ipaddress
import os
import random
import socket

import pytest
import torch

from galaxy.distributed import interface
from galaxy.edge import runs
from galaxy.edge.cgroups import Layout, find_layout
from galaxy.edge.network import pick_subnet
from galaxy.edge.output import Console
from galaxy.edge.shaping import gso_bytes, shape_commands, tbf_sizes
from galaxy.runtime import cgroup
from galaxy.train import summary

GiB = 2 ** 30


def write(path, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def fake_host(tmp_path, version: int):
    """A mountinfo, a /proc/self/cgroup and the cgroup files of a rank limited to 1 GiB inside a
    parent limited to 3 GiB, with a CPU quota of 0.35 cpu, as cgroup v1 (cpu and cpuacct mounted together) or v2 shows them."""
    fs, proc = tmp_path / "fs", tmp_path / "proc"
    if version == 1:
        write(tmp_path / "mountinfo", f"30 25 0:26 / {fs}/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
                                      f"31 25 0:27 / {fs}/memory rw - cgroup cgroup rw,memory\n")
        write(proc / "self" / "cgroup", "5:memory:/job/rank\n4:cpu,cpuacct:/job/rank\n")
        rank = fs / "memory" / "job" / "rank"
        write(rank / "memory.stat", f"cache 0\nhierarchical_memory_limit {GiB}\n")
        write(rank / "memory.max_usage_in_bytes", f"{GiB // 2}\n")
        write(rank / "memory.oom_control", "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
        write(fs / "cpu,cpuacct" / "job" / "rank" / "cpuacct.usage", "2500000000\n")
        write(fs / "cpu,cpuacct" / "job" / "rank" / "cpu.cfs_quota_us", "3500\n")
        write(fs / "cpu,cpuacct" / "job" / "rank" / "cpu.cfs_period_us", "10000\n")
    else:
        write(tmp_path / "mountinfo", f"30 25 0:26 / {fs} rw - cgroup2 cgroup2 rw\n")
        write(fs / "cgroup.controllers", "cpuset cpu io memory pids\n")
        write(proc / "self" / "cgroup", "0::/job/rank\n")
        write(fs / "job" / "memory.max", f"{3 * GiB}\n")
        rank = fs / "job" / "rank"
        write(rank / "memory.max", f"{GiB}\n")
        write(rank / "memory.peak", f"{GiB // 2}\n")
        write(rank / "memory.events", "low 0\nhigh 0\nmax 9\noom 2\noom_kill 2\n")
        write(rank / "cpu.stat", "usage_usec 2500000\nuser_usec 2000000\n")
        write(rank / "cpu.max", "3500 10000\n")
    return cgroup.mounts(str(tmp_path / "mountinfo")), str(proc)


@pytest.mark.parametrize("version", [1, 2])
def test_cgroup_figures_of_a_limited_process(tmp_path, version):
    mount_list, proc = fake_host(tmp_path, version)
    figures = cgroup.own_memory(mount_list, proc)
    assert figures == cgroup.Memory(limit=GiB, peak=GiB // 2, oom_kills=2)
    cpu_dir = cgroup.process_dir("cpuacct" if version == 1 else "cpu", "self", mount_list, proc)
    assert cgroup.cpu_seconds(cpu_dir, version) == 2.5
    assert cgroup.own_cpu_quota(mount_list, proc) == 0.35                    # a device of 0.35 cpu
    no_quota = ("cpu.cfs_quota_us", "-1\n") if version == 1 else ("cpu.max", "max 100000\n")
    write(os.path.join(cpu_dir, no_quota[0]), no_quota[1])
    assert cgroup.own_cpu_quota(mount_list, proc) is None
    layout = find_layout(mount_list)
    assert isinstance(layout, Layout) and layout.version == version
    assert len(layout.run_dirs("gxe-000000")) == 2 if version == 1 else 1    # cpu,cpuacct share one


def test_v2_limit_is_the_least_of_the_ancestors(tmp_path):
    mount_list, proc = fake_host(tmp_path, 2)
    rank = tmp_path / "fs" / "job" / "rank"
    write(rank / "memory.max", "max\n")
    assert cgroup.own_memory(mount_list, proc).limit == 3 * GiB
    write(tmp_path / "fs" / "job" / "memory.max", "max\n")
    assert cgroup.own_memory(mount_list, proc) is None          # nothing limits it: the host's figures apply


def test_v1_without_a_limit_reads_as_none(tmp_path):
    mount_list, proc = fake_host(tmp_path, 1)
    rank = tmp_path / "fs" / "memory" / "job" / "rank"
    write(rank / "memory.stat", "hierarchical_memory_limit 9223372036854771712\n")
    assert cgroup.own_memory(mount_list, proc) is None


def test_a_host_without_the_controllers_is_named(tmp_path):
    write(tmp_path / "mountinfo", f"30 25 0:26 / {tmp_path} rw - cgroup cgroup rw,pids\n")
    found = find_layout(cgroup.mounts(str(tmp_path / "mountinfo")))
    assert isinstance(found, str) and "mounted: pids" in found


def test_trainer_reports_the_cgroups_peak_where_one_limits_the_rank(monkeypatch):
    monkeypatch.setattr(cgroup, "own_memory", lambda: cgroup.Memory(limit=GiB, peak=300 * 2 ** 20, oom_kills=0))
    assert summary.peak_memory_mib(torch.device("cpu")) == (300.0, "cgroup")
    monkeypatch.setattr(cgroup, "own_memory", lambda: None)
    assert summary.peak_memory_mib(torch.device("cpu"))[1] == "RSS"
    done = {"steps": 1, "steps_this_run": 1, "wall_s": 1.0, "tokens_per_s": 1.0, "final_loss": 1.0,
            "peak_memory_mib": [300.0, 250.0], "peak_memory_of": ["cgroup", "cgroup"]}
    text = summary.format_summary(done, torch.device("cpu"))
    assert "peak memory of each rank's cgroup (MiB): rank 0 300, rank 1 250" in text
    done["peak_memory_of"] = ["RSS", "RSS"]
    assert "peak RSS (MiB): rank 0 300" in summary.format_summary(done, torch.device("cpu"))


def test_loopback_rendezvous_binds_nothing(monkeypatch):
    for variable in interface.IFNAME_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    assert interface.bind_to_rendezvous("tcp://127.0.0.1:29500") == ""
    assert interface.bind_to_rendezvous(None) == ""
    assert not any(os.environ.get(v) for v in interface.IFNAME_VARIABLES)


def test_rendezvous_elsewhere_binds_the_routing_interface(monkeypatch):
    for variable in interface.IFNAME_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    route = interface.route_to("192.0.2.200")                 # TEST-NET-1: routed, never answered
    if route.local is None:
        pytest.skip("this host has no route off the machine (no default route)")
    assert route.interface in {name for _, name in socket.if_nameindex()}
    via = interface.bind_to_rendezvous("tcp://192.0.2.200:29500")
    assert via == f" via interface {route.interface} ({route.local})"
    assert [os.environ[v] for v in interface.IFNAME_VARIABLES] == [route.interface] * 2
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")            # the user's choice wins
    monkeypatch.delenv("NCCL_SOCKET_IFNAME")
    assert interface.bind_to_rendezvous("tcp://192.0.2.200:29500") == ""
    assert "NCCL_SOCKET_IFNAME" not in os.environ


def test_torchrun_rendezvous_reads_master_addr(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    assert interface.rendezvous_host("env://") == "10.1.2.3"
    assert interface.rendezvous_host("tcp://box0:29500") == "box0"
    assert interface.rendezvous_host("file:///tmp/x") is None


def test_output_keeps_lines_whole_and_the_bar_on_its_line():
    out = io.BytesIO()
    console = Console(["laptop", "pi"], out, out)
    console.feed(0, "out", b"hello\nwor")
    console.feed(1, "out", b"pi line\n")
    console.feed(0, "out", b"ld\n")
    console.feed(0, "err", b"\rtrain:  10%")
    console.feed(0, "err", b"\rtrain:  20%")
    console.feed(1, "out", b"pi says\n")                       # while rank 0's bar is open
    console.feed(0, "err", b"\rtrain:  30%\rtrain: 100%\n")
    console.note("galaxy.edge: done")
    console.feed(0, "out", b"tail")
    console.feed(0, "out", b"")                                 # the stream closed without a newline
    assert out.getvalue().decode().split("\n") == [
        "laptop | hello", "pi     | pi line", "laptop | world",
        "laptop | train:  10%\rlaptop | train:  20%", "pi     | pi says",
        "laptop | train:  30%\rlaptop | train: 100%", "galaxy.edge: done", "laptop | tail", ""]


def test_token_bucket_sizes_and_the_delay_line():
    assert tbf_sizes(100) == (32768, 32768 + 250_000)          # at least 32 KiB; 20 ms of queue
    assert tbf_sizes(1000) == (125_000, 125_000 + 2_500_000)   # 1 ms of the rate
    plain = shape_commands("eth0", "gxe-000000-1", 300, 0)
    assert plain == [["tc", "-n", "gxe-000000-1", "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "tbf",
                      "rate", "300mbit", "burst", "37500", "limit", "787500"]]
    delayed = shape_commands("gxe-000000-h1", None, 300, 5)
    assert delayed == [["tc", "qdisc", "add", "dev", "gxe-000000-h1", "root", "handle", "1:", "netem", "delay", "5ms",
                        "limit", "1000"],
                       ["tc", "qdisc", "add", "dev", "gxe-000000-h1", "parent", "1:1", "handle", "10:", "tbf",
                        "rate", "300mbit", "burst", "37500", "limit", "787500"]]


def test_gso_skbs_fit_the_smallest_bucket_with_their_headers():
    assert gso_bytes([300, 300]) == 37500 * 1448 // 1514 == 35865
    assert gso_bytes([1000, 300, 100]) == 32768 * 1448 // 1514      # the 100 Mbit/s bucket bounds all
    assert gso_bytes([1000, 1000]) is None                            # 125 KB: the default 64 KB passes
    for mbit in (100, 300):
        # TCP fills an skb with whole segments up to gso_max_size; tbf charges each 1448 bytes of
        # payload with its 66 bytes of Ethernet, IPv4 and TCP headers: 24 x 1514 = 36336 <= 37500
        segments = gso_bytes([mbit]) // 1448
        assert segments >= 20 and segments * 1514 <= tbf_sizes(mbit)[0]


def test_run_names_and_subnets():
    assert runs.run_of("gxe-1a2b3c-h0") == "gxe-1a2b3c" and runs.run_of("gxe-1a2b3c") == "gxe-1a2b3c"
    assert runs.run_of("gxe-1a2b3c-0") == "gxe-1a2b3c" and runs.run_of("eth0") is None
    assert runs.run_of("gxe-xyz") is None
    taken = [ipaddress.ip_network(f"10.{a}.0.0/16") for a in range(160, 250) if a != 200]
    subnet = pick_subnet(taken, random.Random(0))
    assert subnet.prefixlen == 24 and str(subnet).startswith("10.200.")


def test_new_runs_get_their_own_names_and_subnets(tmp_path):
    first, second = runs.new_run(str(tmp_path)), runs.new_run(str(tmp_path))
    assert first.name != second.name and not first.subnet.overlaps(second.subnet)
    assert {r.name for r in runs.read_runs(str(tmp_path))} == {first.name, second.name}
    assert runs.is_live(first)                                  # this process is their launcher
    assert not runs.is_live(runs.Run(first.name, first.subnet, first.pid, (first.started or 0) + 1))
    runs.forget(first.name, str(tmp_path))
    assert [r.name for r in runs.read_runs(str(tmp_path))] == [second.name]


def test_a_ranks_rss_peak_is_its_own_not_its_launchers():
    """ru_maxrss survives exec (a child starts with its parent's peak as a floor); the trainer's
    peak must be the rank's own: a launcher that touched 1 GiB starts a rank that holds torch."""
    import resource
    import subprocess
    import sys

    held = bytearray(1 << 30)                       # 1 GiB, touched: the launcher's peak
    held[::4096] = b"\1" * len(held[::4096])
    launcher = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out = subprocess.run([sys.executable, "-c", "import torch; from galaxy.runtime import cgroup; "
                          "cgroup.own_memory = lambda: None; "      # RSS, even in a memory-limited container
                          "from galaxy.train.summary import peak_memory_mib; "
                          "print(peak_memory_mib(torch.device('cpu'))[0])"],
                         capture_output=True, text=True, check=True).stdout
    del held
    assert float(out) < launcher - 512, (float(out), launcher)
