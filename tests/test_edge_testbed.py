"""The edge testbed emulates what a cluster file says: link rates, CPU shares, memory limits; and it
leaves nothing behind, whether a run ends, is interrupted, or its launcher is killed.

Rates are measured by the ranks themselves (galaxy.edge.probe) through gloo, as Galaxy's
collectives run: a 4 MiB send between two devices (payload rate, TCP/IP headers cost 3-4%), and
GEMMs of one thread timed on each device in turn (the best of 8 windows of 0.3 s, so that another
process's burst on the shared host is not taken for the device's speed).
"""
import json
import signal
import subprocess
import time

import pytest

from galaxy.edge.cgroups import find_layout
from galaxy.edge.shield import SCAN_S, leftover_shields, shield_name
from support.dist_pool import close_pools
from support.edge_launcher import (PROBE, device, edge, leftovers, requires_testbed, run_name, start_edge,
                           write_cluster)

pytestmark = requires_testbed


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    """One 3-device run: links of 300, 300 and 100 Mbit/s; cpus 1.0, 0.5 and 0.4."""
    close_pools()       # their idle workers would take CPU the devices' shares are measured against
    tmp = tmp_path_factory.mktemp("edge_probe")
    cluster = write_cluster(tmp / "probe.json", device("fast", 1.0, link_mbit=300), device("half", 0.5, link_mbit=300),
                            device("slow", 0.4, link_mbit=100, threads=2))
    out = tmp / "probe_result.json"
    done = edge("run", "--cluster", cluster, "--", *PROBE, "link", "gemm", "--rounds", "8", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(out.read_text()), done


def test_transfer_between_300_mbit_devices_runs_at_300(probe):
    result, _ = probe
    for pair in ("0->1", "1->0"):
        assert 0.85 * 300 <= result[pair] <= 1.15 * 300, (pair, result[pair])


def test_transfer_runs_at_the_slower_link(probe):
    result, _ = probe
    for pair in ("0->2", "2->0"):         # 300 Mbit/s at one end, 100 at the other
        assert 0.85 * 100 <= result[pair] <= 1.15 * 100, (pair, result[pair])


def test_tcp_segments_cross_the_links_whole(probe):
    result, _ = probe
    # The sender's veth counted its skbs: TSO/GSO segments that no tbf cut (galaxy.edge.shaping,
    # gso_max_size under the 100 Mbit/s bucket) averaged 23-29 KB here; without the GSO limit
    # 1.5-2.2 KB (8.7 KB from a 300 to the 100 Mbit/s device), each packet then costing softirq
    # time on the devices' cores.
    for pair in ("0->1", "1->0", "0->2", "2->0"):
        assert result[f"skb {pair}"] >= 8192, (pair, result)


def test_half_a_cpu_computes_at_half_the_rate(probe):
    result, _ = probe
    ratio = result["gemm 1"] / result["gemm 0"]
    # 0.39-0.55 over this project's clean-clone runs on a 2-core VM (the best of 8 windows each;
    # a host burst can spoil every window of the half device: 0.394 in stop 38's last run): half
    # within a quarter, not a whole core's or a quarter's.
    assert 0.375 <= ratio <= 0.625, (ratio, result)


def test_every_rank_runs_as_its_own_host_with_its_threads(probe):
    result, _ = probe
    assert [result[f"host {r}"] for r in range(3)] == ["fast", "half", "slow"]
    assert [result[f"threads {r}"] for r in range(3)] == [1, 1, 2]      # ceil(cpus), unless threads


def test_run_reports_every_device_and_leaves_nothing(probe):
    _, done = probe
    for r, name in enumerate(("fast", "half", "slow")):
        assert f"galaxy.edge: device {name} (rank {r}): exit 0, peak memory " in done.stderr
    assert "galaxy.edge: testbed" in done.stderr and " down in " in done.stderr
    assert leftovers(run_name(done.stderr)) == []


def test_device_over_its_memory_limit_is_reported_and_the_run_ends(tmp_path):
    timeout_s = 4
    cluster = write_cluster(tmp_path / "oom.json", device("host", 1.0), device("hog", 0.5, memory_mib=400))
    proc = start_edge("run", "--cluster", cluster, "--", *PROBE, "memory", "--mib", "1024",
                      "--timeout_s", str(timeout_s))
    lines, killed_at = [], None
    for line in proc.stdout:                       # read as it comes, to time the end from the kill
        lines.append(line)
        if "was killed" in line:
            killed_at = time.monotonic()
    status = proc.wait()
    output = "".join(lines)
    assert killed_at is not None, output
    assert time.monotonic() - killed_at <= timeout_s + 10, output
    assert status != 0
    assert "galaxy.edge: device hog (rank 1) was killed: out of memory, limit 400 MiB, peak 4" in output
    assert "galaxy.edge: device hog (rank 1): exit 137" in output
    assert leftovers(run_name(output)) == []


def read_until_ready(proc, devices: int) -> str:
    """The launcher's output up to the point every device has printed 'ready'."""
    seen = ""
    while seen.count("| ready") < devices:
        line = proc.stdout.readline()
        assert line, f"the launcher ended early:\n{seen}"
        seen += line
    return seen


def cpu_cgroup(pid: int) -> str:
    """The cpu cgroup process pid sits in ("/" at the root)."""
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if "cpu" in controllers.split(",") or controllers == "":
                return path
    raise AssertionError(f"no cpu cgroup for {pid}")


def shield_of(name: str) -> str:
    return "/" + shield_name(name)


def test_killed_launcher_is_cleaned_up_and_ctrl_c_stops_a_run(tmp_path):
    # Two shielded testbeds at once, each running ranks that wait; the first launcher is SIGKILLed.
    # A process of the host's (a sleeper in the root cpu cgroup) sits in a shield while either
    # runs, and is back at the root, alive, once clean and the second run's end release them.
    cluster = write_cluster(tmp_path / "two.json", device("a", 0.2, 128), device("b", 0.2, 128))
    waiting = ["--", "sh", "-c", "echo ready; exec sleep 60"]
    host_process = subprocess.Popen(["sleep", "120"])
    first = start_edge("run", "--shield", "--cluster", cluster, *waiting)
    second = start_edge("run", "--shield", "--cluster", cluster, *waiting)
    try:
        out_1, out_2 = read_until_ready(first, 2), read_until_ready(second, 2)
        name_1, name_2 = run_name(out_1), run_name(out_2)
        assert name_1 != name_2 and "; shielded from " in out_1
        time.sleep(2 * SCAN_S)                     # both shields have swept the root
        assert cpu_cgroup(host_process.pid) in (shield_of(name_1), shield_of(name_2))
        first.kill()
        first.wait()
        assert leftovers(name_1)                   # its ranks still sleep in their namespaces
        done = edge("clean", timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"removed {name_1}" in done.stdout and f"left alone {name_2}" in done.stdout
        assert f"released {find_layout().roots['cpu']}{shield_of(name_1)}" in done.stdout
        assert f"left alone {find_layout().roots['cpu']}{shield_of(name_2)}" in done.stdout
        assert leftovers(name_1) == []
        assert leftovers(name_2) and second.poll() is None   # the live run was not touched
        second.send_signal(signal.SIGINT)          # a Ctrl-C
        rest = second.communicate(timeout=60)[0]
        assert second.returncode == 130, rest
        assert "SIGINT: stopping the ranks" in rest
        assert leftovers(name_2) == []
        assert not leftover_shields(find_layout())
        assert cpu_cgroup(host_process.pid) == "/" and host_process.poll() is None
    finally:
        host_process.kill()
        for proc in (first, second):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
                edge("clean", timeout=60)
