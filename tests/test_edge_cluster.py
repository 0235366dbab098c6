"""Cluster files are checked before anything is built: a mistake is one line naming the device and
the key, exit status 2; `check` needs no root; `run` without root, or asking for latency on a kernel
without netem, stops with one line before it creates anything. The shipped clusters are valid."""
import glob
import json
import os

import pytest

from support.edge_launcher import ROOT, device, edge, write_cluster

from galaxy.config import ConfigError
from galaxy.edge import host, runs
from galaxy.edge.__main__ import main as edge_main
from galaxy.edge.cluster import load_cluster

@pytest.mark.parametrize("entry,expected", [
    ({"name": "pi", "cpus": 0.5, "memory_mib": 900}, "devices[0] 'pi': 'link_mbit' is missing"),
    ({**device("pi"), "memory": 900}, "devices[0] 'pi': unknown key 'memory'; did you mean 'memory_mib'?"),
    (device("pi", cpus=0.05), "devices[0] 'pi': cpus must be a number from 0.1 to"),
    (device("pi", cpus=64), "devices[0] 'pi': cpus must be a number from 0.1 to"),
    (device("Pi_4"), "name must be 1-32 lower-case letters, digits or '-'"),
    (device("pi", link_mbit="fast"), "devices[0] 'pi': link_mbit must be a number from 0.1 to 100000, got 'fast'"),
    (device("pi", threads=0), "devices[0] 'pi': threads must be a whole number of at least 1, got 0"),
    (device("pi", cpuset="0-999"), "devices[0] 'pi': cpuset names CPU"),
    (device("pi", cpuset="x"), "devices[0] 'pi': cpuset must list CPUs like"),
])
def test_bad_device_is_one_line(tmp_path, entry, expected):
    path = write_cluster(tmp_path / "c.json", entry)
    with pytest.raises(ConfigError) as e:
        load_cluster(path, cpus={0, 1})
    assert len(e.value.problems) == 1 and expected in e.value.problems[0], e.value.problems


def test_every_problem_is_reported_at_once(tmp_path):
    path = write_cluster(tmp_path / "c.json", device("a", cpus=0), device("a", memory_mib=10))
    with pytest.raises(ConfigError) as e:
        load_cluster(path, cpus={0, 1})
    assert len(e.value.problems) == 2 and "two devices are named 'a'" not in str(e.value)   # bad ones are dropped
    path = write_cluster(tmp_path / "d.json", device("a"), device("a"))
    with pytest.raises(ConfigError, match="two devices are named 'a'"):
        load_cluster(path, cpus={0, 1})


def test_threads_default_to_cpus_rounded_up_and_shares_past_the_host_warn(tmp_path):
    path = write_cluster(tmp_path / "c.json", device("a", 1.5), device("b", 0.4), device("c", 0.4, threads=3))
    cluster = load_cluster(path, cpus={0, 1})
    assert [d.threads for d in cluster.devices] == [2, 1, 3]
    assert cluster.warnings and "add up to 2.3, more than this host's 2 CPUs" in cluster.warnings[0]


def test_cli_exits_2_with_one_line_for_a_bad_file(tmp_path):
    path = write_cluster(tmp_path / "c.json", {**device("pi"), "lnk_mbit": 100})
    for action in (["check"], ["run"]):
        done = edge(*action, "--cluster", path, "--", "true", timeout=60)
        assert done.returncode == 2
        assert done.stderr.splitlines() == [f"python -m galaxy.edge: error: {path}: devices[0] 'pi': unknown key "
                                            f"'lnk_mbit'; did you mean 'link_mbit'?"]
    path = write_cluster(tmp_path / "ok.json", device("pi"))
    done = edge("run", "--cluster", path, "--", "no-such-command", timeout=60)
    assert done.returncode == 2
    assert "python -m galaxy.edge: error: command not found: no-such-command (what every device runs, after --)" \
        in done.stderr.splitlines()
    (tmp_path / "broken.json").write_text("{")
    done = edge("run", "--cluster", str(tmp_path / "broken.json"), "--", "true", timeout=60)
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1 and "not valid JSON" in done.stderr


def test_check_needs_no_root_and_run_without_root_stops_before_making_anything(tmp_path, monkeypatch, capsys):
    # In-process with the user id faked: on hosts where Python lives under /root, no other user can
    # start it at all.
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    path = write_cluster(tmp_path / "c.json", device("laptop"), device("pi", 0.5, link_mbit=100))
    assert edge_main(["check", "--cluster", path, "--", "python", "x.py"]) == 0
    out = capsys.readouterr().out
    assert "rank 1 pi: cpus 0.5 (CFS quota 5000 us per 10000 us), 1 torch thread, memory 2000 MiB" in out
    assert "tbf rate 100mbit burst 32768 limit 282768" in out
    assert "pi: OMP_NUM_THREADS=1 python x.py --world 2 --rank 1 --init_method tcp://10." in out
    assert "host: cannot run it here:\n  not root" in out
    monkeypatch.setattr(runs, "new_run", lambda: pytest.fail("run made something without root"))
    assert edge_main(["run", "--cluster", path, "--", "true"]) == 2
    assert capsys.readouterr().err.startswith("python -m galaxy.edge: error: not root: the testbed makes network")



def test_shield_env_turns_the_flag_on_for_runs_that_do_not_pass_it(monkeypatch):
    from galaxy.edge.__main__ import parse_args
    argv = ["run", "--cluster", "c.json", "--", "true"]
    monkeypatch.delenv("GALAXY_EDGE_SHIELD", raising=False)
    assert not parse_args(argv).shield and parse_args(["run", "--shield", *argv[1:]]).shield
    monkeypatch.setenv("GALAXY_EDGE_SHIELD", "0")
    assert not parse_args(argv).shield
    monkeypatch.setenv("GALAXY_EDGE_SHIELD", "1")
    assert parse_args(argv).shield

def test_latency_is_refused_where_the_kernel_has_no_netem(tmp_path):
    if host.has_feature("netem", host.kernel_config()) is not False:
        pytest.skip("this kernel has netem (or does not say): latency_ms is allowed here")
    path = write_cluster(tmp_path / "c.json", device("laptop"), device("pi", latency_ms=5))
    done = edge("run", "--cluster", path, "--", "true", timeout=60)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if "latency_ms" in line]
    assert lines == ["python -m galaxy.edge: error: latency_ms (device pi) needs the kernel's netem qdisc, which "
                     "this kernel lacks (CONFIG_NET_SCH_NETEM); remove latency_ms from the cluster file"]


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "clusters", "*.json"))),
                         ids=os.path.basename)
def test_shipped_clusters_are_valid_and_fit_two_cores(path):
    cluster = load_cluster(path, cpus={0, 1})
    assert not cluster.warnings
    assert sum(d.cpus for d in cluster.devices) <= 2
    assert json.load(open(path))["_comment"]


def test_shipped_clusters_include_the_issue_ones():
    names = {os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "clusters", "*.json"))}
    assert {"two_equal_1g.json", "home3.json"} <= names
    assert any(len(load_cluster(os.path.join(ROOT, "clusters", n), cpus={0, 1}).devices) == 4 for n in names)
