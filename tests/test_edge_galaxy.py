"""Galaxy's own scripts on the edge testbed, each rank on a device of its own (namespace, link, cgroups).

- pretrain_galaxy.py (a tiny BERT, uneven TP+SP shares) reports HF's serial losses, as every
  parity test demands, with the ranks binding gloo to the interface that routes to rank 0
  (without that binding gloo offers 127.0.0.1 and the ranks never connect);
- plan.py profile-devices records each device's memory limit from its cgroup, its name, and every
  pair's send rate (the slower end's link);
- a rank whose rendezvous cannot connect fails within timeout_s with one line naming the address
  and the interface it tried.
"""
import json
import os
import time

from support.edge_launcher import PYTHON, ROOT, device, edge, leftovers, requires_testbed, run_name, write_cluster
from test_entry_scripts import hf_losses, write_config
from test_entry_scripts import job  # noqa: F401  (the fixture: a tiny BERT and its training data)

from galaxy.train.metrics import read_metrics

pytestmark = requires_testbed
LAUNCH_TARGET = os.path.join(ROOT, "tests", "support", "launch_target.py")


def test_galaxy_plan_on_two_devices_reports_hf_losses(job, tmp_path):  # noqa: F811
    config, metrics_file = write_config(job, "edge-galaxy", att_parallel_method="TP", con_parallel_method="SP",
                                        mlp_parallel_method="TP", tp_num_attention_heads_list=[4, 2],
                                        tp_intermediate_size_list=[60, 36], seq_scatter_list=[9, 7])
    cluster = write_cluster(tmp_path / "two.json", device("box0", 1.0, 1500), device("box1", 1.0, 1500))
    done = edge("run", "--cluster", cluster, "--", PYTHON, "pretrain_galaxy.py", "--config_file", config)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "peak memory of each rank's cgroup (MiB): rank 0 " in done.stdout
    steps = [r for r in read_metrics(metrics_file) if "step" in r and "event" not in r]
    want = hf_losses(job)
    assert len(steps) == len(want)
    for r, ref in zip(steps, want):
        assert abs(r["loss"] - ref) <= 1e-5 * abs(ref), (r["loss"], ref)
    assert leftovers(run_name(done.stderr)) == []


def test_profile_devices_records_each_device_and_its_memory_limit(job, tmp_path):  # noqa: F811
    base = tmp_path / "base.json"
    base.write_text(json.dumps({"model_path": job["model_dir"], "pad_size": 12, "batch_size": 4, "timeout_s": 60}))
    cluster = write_cluster(tmp_path / "three.json", device("big", 1.0, 1500, 1000), device("small", 0.5, 1000, 300),
                            device("tiny", 0.5, 1000, 100))
    out = tmp_path / "devices.json"
    done = edge("run", "--cluster", cluster, "--", PYTHON, "plan.py", "profile-devices", "--config_file", str(base),
                "--out", str(out), "--quick")
    assert done.returncode == 0, done.stdout + done.stderr
    profile = json.loads(out.read_text())
    devices = profile["devices"]
    assert [d["name"] for d in devices] == ["big rank 0", "small rank 1", "tiny rank 2"]
    assert [d["memory_mib"] for d in devices] == [1500, 1000, 1000]
    assert [d["threads"] for d in devices] == [1, 1, 1]
    # a send between every pair, each at the slower end's link (through one switch)
    rates = {tuple(p["ranks"]): p["bytes_per_s"] * 8 / 1e6 for p in profile["link"]["pairs"]}
    assert sorted(rates) == [(0, 1), (0, 2), (1, 2)]
    for pair, mbit in ((0, 1), 300), ((0, 2), 100), ((1, 2), 100):
        assert abs(rates[pair] - mbit) <= 0.15 * mbit, rates


def test_rendezvous_that_cannot_connect_names_address_and_interface(job, tmp_path):  # noqa: F811
    timeout_s = 3
    config, _ = write_config(job, "edge-unreachable")
    with open(config) as f:
        cfg = json.load(f)
    with open(config, "w") as f:
        json.dump({**cfg, "timeout_s": timeout_s}, f)
    cluster = write_cluster(tmp_path / "two.json", device("box0", 1.0), device("box1", 1.0))
    # Rank 0 sleeps instead of serving the rendezvous: rank 1 finds nobody at device 0's address.
    # Rank 1 runs galaxy.launch's rendezvous through its test target, which imports no model code
    # (pretrain_galaxy.py's rendezvous is the same function, after seconds more of imports).
    script = f'if [ "$4" = 0 ]; then exec sleep 30; fi; exec {PYTHON} {LAUNCH_TARGET} --config_file {config} "$@"'
    t0 = time.monotonic()
    done = edge("run", "--cluster", cluster, "--grace_s", "1", "--", "sh", "-c", script, "sh")
    elapsed = time.monotonic() - t0
    lines = [line for line in done.stdout.splitlines() + done.stderr.splitlines() if "rendezvous at" in line]
    assert len(lines) == 1, done.stdout + done.stderr
    address = lines[0].split("rendezvous at tcp://")[1].split(":")[0]
    assert f"box1 | launch_target.py: rank 1: rendezvous at tcp://{address}:29500 via interface eth0 (" in lines[0]
    assert "galaxy.edge: device box1 (rank 1): exit 1" in done.stderr
    assert elapsed < timeout_s + 30           # torch's import, the timeout, the grace; not gloo's own minutes
    assert leftovers(run_name(done.stderr)) == []
