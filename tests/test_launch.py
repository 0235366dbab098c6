"""galaxy.launch end to end: real processes running tests/support/launch_target.py over gloo.

Where how a process ends is what is tested (exit status and stderr of a fresh interpreter, a peer
that dies, hangs, rendezvous that fail) each rank is a fresh process. Runs that end as a script
ends on the command drivers (an argument error raised before any process group, a world-2 run
that finishes) run there instead (support.script_runner.run_argvs: `python launch_target.py ...`
without importing torch again, about 3 s of CPU a process); test_bad_config_one_line_exit_2 keeps
a fresh interpreter's stderr to exactly the one line.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.dist_pool import free_port
from support.script_runner import run_argvs
from galaxy.distributed import waiting
from galaxy.launch import parse_args

REPO = Path(__file__).resolve().parents[1]
TARGET = str(REPO / "tests" / "support" / "launch_target.py")
BERT = {"model_type": "bert", "num_attention_heads": 6, "intermediate_size": 96,
        "hidden_size": 48, "num_hidden_layers": 2, "max_position_embeddings": 64}
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def config(tmp_path):
    """Write a config for a tiny model dir; returns its path."""
    def _config(**keys):
        model = tmp_path / "model"
        model.mkdir(exist_ok=True)
        (model / "config.json").write_text(json.dumps(BERT))
        path = tmp_path / "config.json"
        path.write_text(json.dumps({"model_path": str(model), "pad_size": 16,
                                    "distributed_backend": "gloo", "timeout_s": 20, **keys}))
        return str(path)
    return _config


# Seconds a rank may spend starting (importing torch and transformers takes ~10 s on a loaded
# 2-core machine, 20-25 s under a load of 100) on top of timeout_s: still below the ~50 s gloo
# connect wait these tests guard against.
STARTUP_S = 30


def start(args, **env_extra) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env.update(PYTHONPATH=str(REPO), **env_extra)
    return subprocess.Popen([sys.executable, TARGET, *args], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def on_drivers(*ranks) -> list[tuple]:
    """Each rank's (exit status, stdout, stderr) of launch_target.py with its arguments, run on the
    command drivers; "{port}" in an argument is a free port, leading NAME=VALUE words its
    environment (as the shell reads them)."""
    def argv(words):
        n = next((i for i, w in enumerate(words) if w.startswith("-") or "=" not in w), len(words))
        return [*words[:n], os.path.relpath(TARGET, REPO), *words[n:]]
    return run_argvs([[argv(words) for words in ranks]])[0]


def finish(proc, timeout=60):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"process hung; stderr:\n{err}")
    return proc.returncode, out, err


def test_bad_config_one_line_exit_2(config, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(open(config(pad_size=0)).read())
    procs = [start(["--config_file", str(bad)]),       # both at once: each spends seconds importing torch
             start(["--config_file", config(), "--world", "2", "--rank", "5"])]
    (code, out, err), (code2, _, err2) = map(finish, procs)
    assert code == 2
    assert err.splitlines() == ["launch_target.py: error: pad_size must be at least 1, got 0"]
    assert code2 == 2 and len(err2.splitlines()) == 1 and "--rank 5" in err2 and "Traceback" not in err2


def test_argparse_error_is_one_line():
    (code, _, err), = on_drivers([])
    assert code == 2 and err.splitlines() == [
        "launch_target.py: error: the following arguments are required: --config_file/--config"]


def test_single_process(config, tmp_path):
    system = tmp_path / "system.json"
    system.write_text(open(config(cpu_allocator="system")).read())
    procs = [start(["--config_file", config()]), start(["--config_file", str(system)])]     # both at once
    (code, out, err), (code2, out2, err2) = map(finish, procs)
    assert code == 0, err
    assert "freed_memory_stays=True" in out           # cpu_allocator "keep", the default
    assert code2 == 0, err2
    assert "freed_memory_stays=False" in out2         # glibc unmaps a 64 MiB block on free
    assert "rank 0/1 ok backend=gloo device=cpu" in out2


def test_two_ranks_over_tcp(config):
    cfg = config()
    outcome = on_drivers(*[["--config_file", cfg, "--world", "2", "--rank", str(r), "--init_method",
                            "tcp://127.0.0.1:{port}"] for r in range(2)])
    # comm_wait auto: two ranks on one host poll when the host gives them two cores, else block.
    waits = "poll" if len(waiting.usable_core_ids()) >= 2 else "block"
    for r, (code, out, err) in enumerate(outcome):
        assert code == 0, err
        assert f"rank {r}/2 ok backend=gloo device=cpu waits={waits}" in out


def test_torchrun_env(config):
    """RANK is the launch rank; mesh_rank_order [1, 0] puts it at the other mesh position (the
    default group's rank), while launch rank 0 still hosts the rendezvous at MASTER_ADDR."""
    cfg = config(mesh_rank_order=[1, 0])
    outcome = on_drivers(*[[f"RANK={r}", "WORLD_SIZE=2", f"LOCAL_RANK={r}", "MASTER_ADDR=127.0.0.1",
                            "MASTER_PORT={port}", "--config_file", cfg] for r in range(2)])
    for r, (code, out, err) in enumerate(outcome):
        assert code == 0, err
        assert f"rank {r}/2 ok" in out and f"position={1 - r} group_rank={1 - r}" in out, out


def test_torchrun_env_disagreeing_with_flags(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = parse_args(["--config_file", "c.json"], "x.py")
    assert (args.rank, args.world, args.init_method) == (1, 2, "env://")
    with pytest.raises(SystemExit) as info:
        parse_args(["--config_file", "c.json", "--world", "4"], "x.py")
    assert info.value.code == 2


def test_peer_death_fails_fast_and_the_message_starts_a_line_of_its_own(config):
    """Rank 1 dies while rank 0 draws a progress bar (as the trainer does): rank 0 stops within
    timeout_s, its one message on a line of its own after the bar's."""
    timeout_s = 10
    cfg, url = config(timeout_s=timeout_s), f"tcp://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    procs = [start(["--config_file", cfg, "--world", "2", "--rank", str(r), "--init_method", url],
                   LAUNCH_TARGET_DIE_RANK="1", LAUNCH_TARGET_BAR="1") for r in range(2)]
    code, _, err = finish(procs[0], timeout=timeout_s + STARTUP_S + 5)
    assert time.monotonic() - t0 < timeout_s + STARTUP_S
    assert code == 1
    assert "launch_target.py: rank 0: a collective failed or timed out (a peer may have died)" in err
    assert "Traceback" not in err
    assert "train:" in err                                  # the bar was drawn
    assert any(line.startswith("launch_target.py: rank 0: a collective failed") for line in err.splitlines()), err
    assert finish(procs[1])[0] == 9


def test_rendezvous_timeout_when_peer_never_starts(config):
    cfg = config(timeout_s=3)
    t0 = time.monotonic()
    proc = start(["--config_file", cfg, "--world", "2", "--rank", "0",
                  "--init_method", f"tcp://127.0.0.1:{free_port()}"])
    code, _, err = finish(proc, timeout=45)
    assert code == 1 and time.monotonic() - t0 < 3 + STARTUP_S
    assert "launch_target.py: rank 0: rendezvous at tcp://127.0.0.1" in err


# --- the rendezvous: arguments, agreement between ranks, one job per port (issue 16) --------

def test_init_method_without_port_is_an_argument_error(config):
    t0 = time.monotonic()
    (code, _, err), = on_drivers(["--config_file", config(), "--world", "2", "--init_method", "tcp://127.0.0.1"])
    assert code == 2 and time.monotonic() - t0 < STARTUP_S
    assert err.splitlines() == ["launch_target.py: error: --init_method tcp://127.0.0.1 has no port; give "
                                "tcp://HOST:PORT with rank 0's address (e.g. tcp://127.0.0.1:29500)"]


def lines_of(err: str) -> list[str]:
    """stderr without c10d's own warnings (lines starting with "[W")."""
    return [line for line in err.splitlines() if line.strip() and not line.startswith("[W")]


def test_ranks_with_different_settings_all_exit_2_naming_the_key(config, tmp_path):
    url = f"tcp://127.0.0.1:{free_port()}"
    configs = [config(timeout_s=60, tp_num_attention_heads_list=[3, 3])]
    other = tmp_path / "other.json"
    other.write_text(Path(configs[0]).read_text().replace("[3, 3]", "[4, 2]"))
    t0 = time.monotonic()
    procs = [start(["--config_file", c, "--world", "2", "--rank", str(r), "--init_method", url])
             for r, c in enumerate([configs[0], str(other)])]
    for r, proc in enumerate(procs):
        code, _, err = finish(proc, timeout=55)
        assert code == 2, err
        assert lines_of(err) == [f"launch_target.py: rank {r}: error: rank 1's settings differ from rank 0's at "
                                 "tp_num_attention_heads_list: [3, 3] on rank 0, [4, 2] on rank 1; start every rank "
                                 "with the same config and arguments"]
    assert time.monotonic() - t0 < STARTUP_S + 10      # no wait for timeout_s (60): they disagree at once


def test_ranks_with_different_world_sizes_stop_at_once(config):
    cfg, url = config(timeout_s=10), f"tcp://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    procs = [start(["--config_file", cfg, "--world", str(w), "--rank", str(r), "--init_method", url])
             for r, w in ((0, 2), (1, 3), (2, 3))]
    for proc in procs:
        code, _, err = finish(proc, timeout=40)
        assert code == 2 and "ranks disagree on the world size: rank 0 has --world 2" in err, err
        assert len(lines_of(err)) == 1
    assert time.monotonic() - t0 < 10 + STARTUP_S


def test_a_second_job_on_a_busy_port_stops_at_once_and_the_first_goes_on(config, tmp_path):
    cfg, port = config(timeout_s=10), free_port()
    url, release = f"tcp://127.0.0.1:{port}", tmp_path / "release"
    first = [start(["--config_file", cfg, "--world", "2", "--rank", str(r), "--init_method", url],
                   LAUNCH_TARGET_HOLD=str(release)) for r in range(2)]
    assert first[0].stdout.readline() == "rank 0 joined\n"   # past its rendezvous, holding the port
    t0 = time.monotonic()
    second = [start(["--config_file", cfg, "--world", "2", "--rank", str(r), "--init_method", url])
              for r in range(2)]
    try:
        results = [finish(proc, timeout=40) for proc in second]
    finally:
        release.touch()
    assert time.monotonic() - t0 < 10 + STARTUP_S
    (code0, _, err0), (code1, _, err1) = results
    assert code0 == 1 and lines_of(err0) == [
        f"launch_target.py: rank 0: rendezvous at {url} failed: port {port} on 127.0.0.1 is in use (by another "
        "job?); give this job a free port in --init_method, the same on every rank"]
    assert code1 == 1 and lines_of(err1) == [
        f"launch_target.py: rank 1: rendezvous at {url} failed: rank 1 has already joined it: the port is in use by "
        "another job (or two processes were given --rank 1); give this job a free port in --init_method"]
    for r, proc in enumerate(first):
        code, out, err = finish(proc)
        assert code == 0 and f"rank {r}/2 ok" in out, err
