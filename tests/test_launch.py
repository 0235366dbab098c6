"""galaxy.launch end to end: real processes running tests/launch_target.py over gloo."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from galaxy.launch import parse_args

REPO = Path(__file__).resolve().parents[1]
TARGET = str(REPO / "tests" / "launch_target.py")
BERT = {"model_type": "bert", "num_attention_heads": 6, "intermediate_size": 96,
        "hidden_size": 48, "num_hidden_layers": 2, "max_position_embeddings": 64}
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def start(args, **env_extra) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env.update(PYTHONPATH=str(REPO), **env_extra)
    return subprocess.Popen([sys.executable, TARGET, *args], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(proc, timeout=60):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"process hung; stderr:\n{err}")
    return proc.returncode, out, err


def test_bad_config_one_line_exit_2(config):
    code, out, err = finish(start(["--config_file", config(pad_size=0)]))
    assert code == 2
    assert err.splitlines() == ["launch_target.py: error: pad_size must be at least 1, got 0"]
    code, _, err = finish(start(["--config_file", config(), "--world", "2", "--rank", "5"]))
    assert code == 2 and len(err.splitlines()) == 1 and "--rank 5" in err and "Traceback" not in err


def test_argparse_error_is_one_line():
    code, _, err = finish(start([]))
    assert code == 2 and err.splitlines() == [
        "launch_target.py: error: the following arguments are required: --config_file/--config"]


def test_single_process(config):
    code, out, err = finish(start(["--config_file", config()]))
    assert code == 0, err
    assert "rank 0/1 ok backend=gloo device=cpu" in out


def test_two_ranks_over_tcp(config):
    cfg, url = config(), f"tcp://127.0.0.1:{free_port()}"
    procs = [start(["--config_file", cfg, "--world", "2", "--rank", str(r), "--init_method", url])
             for r in range(2)]
    for r, proc in enumerate(procs):
        code, out, err = finish(proc)
        assert code == 0, err
        assert f"rank {r}/2 ok" in out


def test_torchrun_env(config):
    cfg, port = config(), str(free_port())
    procs = [start(["--config_file", cfg], RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port) for r in range(2)]
    for r, proc in enumerate(procs):
        code, out, err = finish(proc)
        assert code == 0, err
        assert f"rank {r}/2 ok" in out


def test_torchrun_env_disagreeing_with_flags(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = parse_args(["--config_file", "c.json"], "x.py")
    assert (args.rank, args.world, args.init_method) == (1, 2, "env://")
    with pytest.raises(SystemExit) as info:
        parse_args(["--config_file", "c.json", "--world", "4"], "x.py")
    assert info.value.code == 2


def test_peer_death_fails_fast(config):
    timeout_s = 10
    cfg, url = config(timeout_s=timeout_s), f"tcp://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    procs = [start(["--config_file", cfg, "--world", "2", "--rank", str(r), "--init_method", url],
                   LAUNCH_TARGET_DIE_RANK="1") for r in range(2)]
    code, _, err = finish(procs[0], timeout=timeout_s + 15)
    assert time.monotonic() - t0 < timeout_s + 15
    assert code == 1
    assert "launch_target.py: rank 0: a collective failed or timed out (a peer may have died)" in err
    assert "Traceback" not in err
    assert finish(procs[1])[0] == 9


def test_rendezvous_timeout_when_peer_never_starts(config):
    cfg = config(timeout_s=3)
    t0 = time.monotonic()
    proc = start(["--config_file", cfg, "--world", "2", "--rank", "0",
                  "--init_method", f"tcp://127.0.0.1:{free_port()}"])
    code, _, err = finish(proc, timeout=30)
    assert code == 1 and time.monotonic() - t0 < 20
    assert "launch_target.py: rank 0: rendezvous at tcp://127.0.0.1" in err
