"""A process killed in the middle of a save leaves the previous checkpoint loadable.

A real training run (the serial entry point, in a fresh process) saves at steps 2 and 4; a hook in
the safetensors writer SIGKILLs the process halfway through the second save, after a torn file
has been written. Then: `latest` still names step 2, that checkpoint loads in transformers, and
`resume: "latest"` finishes the run with the losses of an uninterrupted run.
"""
import os
import signal
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from support.script_runner import run_scripts
from support.trainer_support import make_workspace, step_losses, train_on_rank, write_config

from galaxy.train.checkpoint import latest_checkpoint, step_dir_name

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = dict(num_epochs=2, max_steps=6, save_interval=2, lr_schedule="cosine", warmup_steps=1)

# Runs the serial entry point; the N-th safetensors write tears its file and SIGKILLs the process
# (each save writes model, optimizer and rng files: N = 5 is the optimizer file of the 2nd save).
KILLER = """
import os, signal, sys
import galaxy.files as files
real, calls, kill_at = files.save_file, [0], int(sys.argv[2])
def save_file(tensors, path, metadata=None):
    calls[0] += 1
    if calls[0] == kill_at:
        with open(path, "wb") as f:
            f.write(b"torn" * 1000)
        os.kill(os.getpid(), signal.SIGKILL)
    return real(tensors, path, metadata=metadata)
files.save_file = save_file
from galaxy.launch import main
from galaxy.train.trainer import prepare_classifier, train_classifier
main(preset="serial", prepare_fn=prepare_classifier, train_fn=train_classifier, script="killed.py",
     argv=["--config_file", sys.argv[1]])
"""


def run_serial(args):
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("kill"), n_train=24)


def test_kill_during_save_keeps_the_previous_checkpoint(dist_pool, ws):
    from transformers import BertForSequenceClassification
    save_dir = os.path.join(ws["root"], "ck")
    config = write_config(ws, "killed", save_dir=save_dir, **RUN)
    killed = run_serial(["-c", KILLER, config, "5"])
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    assert [n for n in os.listdir(save_dir) if n.startswith(".step-00000004.tmp-")], "the kill must hit the save"

    ckpt = latest_checkpoint(save_dir)
    assert ckpt.step == 2
    assert not os.path.exists(os.path.join(save_dir, step_dir_name(4)))
    BertForSequenceClassification.from_pretrained(ckpt.model_dir)
    assert load_file(os.path.join(ckpt.path, "optimizer.safetensors"))

    # the resume on a command driver (support.script_runner), as `python pretrain_bert.py ...` runs
    ((code, out, err),), = run_scripts([("pretrain_bert.py", write_config(ws, "killed", save_dir=save_dir,
                                                                        resume="latest", **RUN), 1)])
    assert code == 0, out + err
    assert "continuing from" in out + err
    assert sorted(os.listdir(save_dir)) == ["latest", step_dir_name(2), step_dir_name(4), step_dir_name(6)]

    dist_pool(1).run(train_on_rank, write_config(ws, "uninterrupted", save_dir=save_dir + "_ref", **RUN))
    want = step_losses(os.path.join(ws["root"], "uninterrupted", "metrics.jsonl"))
    got = step_losses(os.path.join(ws["root"], "killed", "metrics.jsonl"))
    assert sorted(got) == list(range(1, 7))
    assert max(abs(got[k] - want[k]) for k in range(3, 7)) <= 1e-6
