"""The trainer through an entry script, as users run it: evaluation events, summary, plot, errors.

pretrain_galaxy.py on 2 processes with eval_interval, a test set, clipping and metrics_file; and a
bad row in a held-out file, which must stop the script before any process group starts. Both run
on the session's command drivers (tests/support/script_runner.py: no torch import per run; an
exit 2 keeps the driver); the diverging run, which exits 1, in a fresh process.
"""
import os

import pytest

from support.script_runner import launch as launch_script, run_scripts
from support.trainer_support import GALAXY_W2, make_workspace, write_config

from galaxy.train.metrics import read_metrics



def launch(config, world):
    return launch_script("pretrain_galaxy.py", config, world)


def on_drivers(config, world):
    return run_scripts([("pretrain_galaxy.py", config, world)], without=())[0]     # with matplotlib: the plot


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("scripts"), n_train=32)


def test_galaxy_script_evaluates_summarises_and_plots(ws):
    config = write_config(ws, "e2e", max_steps=4, eval_interval=2, clip_grad=1.0, **GALAXY_W2)
    (code0, out0, err0), (code1, out1, err1) = on_drivers(config, 2)
    assert (code0, code1) == (0, 0), err0 + err1
    metrics_file = os.path.join(ws["root"], "e2e", "metrics.jsonl")
    records = read_metrics(metrics_file)

    assert records[0]["event"] == "start" and records[0]["resumed_from"] is None
    steps = [r for r in records if "event" not in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(set(r) == {"step", "loss", "lr", "tokens", "time_s", "grad_norm"} for r in steps)
    evals = [r for r in records if r.get("event") == "eval"]
    assert [r["step"] for r in evals] == [2, 4]
    assert all(set(r) == {"event", "step", "loss", "accuracy"} and 0 <= r["accuracy"] <= 1 for r in evals)
    (test,) = [r for r in records if r.get("event") == "test"]
    assert test["step"] == 4
    done = records[-1]
    assert done["event"] == "done" and done["steps"] == 4 and len(done["peak_memory_mib"]) == 2
    assert done["dev_accuracy"] == evals[-1]["accuracy"] and done["tokens_per_s"] > 0

    # Rank 0 prints the summary and draws the plot; rank 1 stays quiet.
    assert "dev: loss" in out0 and "test: loss" in out0 and "peak RSS (MiB): rank 0" in out0 and ", rank 1 " in out0
    assert "train:" in err0                               # tqdm's bar
    assert "done:" not in out1
    with open(os.path.join(ws["root"], "e2e", "metrics.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_a_bad_row_in_the_test_file_stops_before_training(ws, tmp_path):
    bad = tmp_path / "test.tsv"
    bad.write_text("a fine passage\tlexical\nno label here\nanother\tlexical\n")
    config = write_config(ws, "bad", test_path=str(bad), max_steps=1)
    for code, out, err in on_drivers(config, 1):
        assert code == 2, out + err
        assert f"{bad}:2: missing tab" in err
        assert "Traceback" not in err


def test_a_diverging_loss_stops_with_one_line_naming_the_step(ws):
    config = write_config(ws, "nan", max_steps=3, optimizer="sgd", learning_rate=1e30)
    ((code, out, err),) = launch(config, 1)
    assert code == 1, out + err
    assert "Traceback" not in err
    # On a line of its own, after the progress bar's.
    assert ("pretrain_galaxy.py: rank 0: training stopped: the loss became nan at step 2; lower learning_rate, "
            "set clip_grad, or check the data") in err.splitlines()
