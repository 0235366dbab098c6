"""Bad input and damaged files, found before any process group starts (issue 16).

Each case runs an entry point's galaxy.launch.main in this process, as the script would run it,
with init_distributed replaced by a tripwire: a case must end before the rendezvous. Checked: the
exit status, one line on stderr naming the key or file and the fix, no traceback, and nothing
written (save_dir, export_dir and metrics_file are not created). --check cases exit 0 with the
summary. A tiny BERT (2 layers, hidden 48) with the real MiniLM tokenizer; checkpoints from one
short run in the process pool.
"""
import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from support.tiny_models import make_tiny_bert
from support.trainer_support import CLASSES, TOKENIZER_FILES, make_workspace, step_losses, train_on_rank, write_config

import galaxy.launch as launch
from galaxy.models.registry import FAMILIES
from galaxy.train.checkpoint import step_dir_name
from galaxy.train.trainer import prepare_causal_lm, prepare_classifier, train


class ReachedTheProcessGroup(BaseException):
    """Raised by the tripwire; a BaseException so that main's handlers let it through."""


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("bad_input"), n_train=24)


@pytest.fixture(scope="module")
def checkpoints(ws, dist_pool):
    """save_dir with step-2 and step-4 of a 4-step serial run."""
    save_dir = os.path.join(ws["root"], "ck")
    dist_pool(1).run(train_on_rank, write_config(ws, "saved", num_epochs=2, max_steps=4, save_dir=save_dir,
                                                 save_interval=2))
    return save_dir


def model_copy(ws, name, tokenizer=True, **config_changes) -> str:
    """A copy of the workspace's model folder (tokenizer files linked), config.json changed."""
    path = os.path.join(ws["root"], name)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    for entry in os.listdir(ws["model_dir"]):
        source = os.path.join(ws["model_dir"], entry)
        if entry in TOKENIZER_FILES:
            if tokenizer:
                os.symlink(os.path.realpath(source), os.path.join(path, entry))
        else:
            shutil.copy(source, path)
    if config_changes:
        with open(os.path.join(path, "config.json")) as f:
            hf = json.load(f)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({**hf, **config_changes}, f)
    return path


def outputs(ws, name):
    return {key: os.path.join(ws["root"], name, sub) for key, sub in
            (("save_dir", "ck"), ("export_dir", "hf"), ("metrics_file", "metrics.jsonl"))}


def run_entry(monkeypatch, capsys, config, *extra, script="pretrain_bert.py", preset="serial",
              prepare=prepare_classifier):
    """(exit status, stdout, stderr) of the entry point; fails if it reaches the process group."""
    def tripwire(*args, **kwargs):
        raise ReachedTheProcessGroup
    monkeypatch.setattr(launch, "init_distributed", tripwire)
    capsys.readouterr()         # what the setup printed (save_pretrained's progress bar)
    try:
        launch.main(preset=preset, train_fn=train, script=script, prepare_fn=prepare,
                    argv=["--config_file", config, *extra])
        code = 0
    except SystemExit as e:
        code = e.code
    except ReachedTheProcessGroup:
        pytest.fail("the checks passed and the run went on to the process group")
    out, err = capsys.readouterr()
    assert not dist.is_initialized()
    return code, out, err


def refused(monkeypatch, capsys, ws, name, *extra, **keys) -> str:
    """Run a config that must be refused; returns its one error line, after checking the rest."""
    paths = outputs(ws, name)
    code, out, err = run_entry(monkeypatch, capsys, write_config(ws, name, **{**paths, **keys}), *extra)
    assert code == 2, out + err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("pretrain_bert.py: error: ")
    for key, path in paths.items():
        if key not in keys:
            assert not os.path.exists(path), f"{key} {path} was written"
    return err.strip()


# --- 1. model files and paths --------------------------------------------------------------------

def test_model_folder_without_weights(monkeypatch, capsys, ws):
    model = model_copy(ws, "m-noweights")
    os.remove(os.path.join(model, "model.safetensors"))
    line = refused(monkeypatch, capsys, ws, "noweights", model_path=model)
    assert f"model_path '{model}' has config.json but no weights" in line and "model.safetensors" in line


def test_truncated_weights_name_the_file(monkeypatch, capsys, ws):
    model = model_copy(ws, "m-truncated")
    weights = os.path.join(model, "model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    line = refused(monkeypatch, capsys, ws, "truncated", model_path=model)
    assert f"model_path '{model}': model.safetensors (" in line
    assert "cannot be read" in line and "truncated or damaged, copy it again" in line


def test_weights_that_do_not_fit_config_json(monkeypatch, capsys, ws):
    model = model_copy(ws, "m-shapes", intermediate_size=64)       # the weights have 96
    line = refused(monkeypatch, capsys, ws, "shapes", model_path=model)
    assert "intermediate.dense.weight' has shape (96, 48), the model needs (64, 48) in model.safetensors" in line
    assert "do not fit its config.json" in line


def test_classifier_smaller_than_the_class_list(monkeypatch, capsys, ws):
    model = model_copy(ws, "m-head3")
    make_tiny_bert(model, vocab_size=30522, num_labels=3)
    line = refused(monkeypatch, capsys, ws, "head3", model_path=model)
    assert ("its classifier (classifier.weight in model.safetensors) has 3 outputs but the task has 6 classes"
            in line)
    assert '"ignore_mismatched_sizes": true' in line


def test_ignore_mismatched_sizes_starts_a_new_head_like_a_headless_checkpoint(dist_pool, ws):
    head3 = model_copy(ws, "m-head3b")
    make_tiny_bert(head3, vocab_size=30522, num_labels=3)
    headless = model_copy(ws, "m-headless")
    weights = os.path.join(headless, "model.safetensors")
    save_file({k: v for k, v in load_file(weights).items() if not k.startswith("classifier.")}, weights)
    runs = {}
    for name, model, keys in (("reinit", head3, {"ignore_mismatched_sizes": True}), ("fresh", headless, {})):
        config = write_config(ws, name, model_path=model, max_steps=1, **keys)
        runs[name] = dist_pool(1).run(train_on_rank, config, "galaxy", classifier_of)[0][1]
    assert runs["reinit"][0].shape == (len(CLASSES), 48)
    assert all(torch.equal(a, b) for a, b in zip(runs["reinit"], runs["fresh"]))


def classifier_of(trainer):
    return [t.detach().clone() for t in (trainer.model.classifier.weight, trainer.model.classifier.bias)]


def test_resume_checkpoint_of_another_model_shape(monkeypatch, capsys, ws, checkpoints):
    model = model_copy(ws, "m-3layers")
    make_tiny_bert(model, vocab_size=30522, num_labels=len(CLASSES), num_hidden_layers=3)
    line = refused(monkeypatch, capsys, ws, "othershape", model_path=model,
                   resume=os.path.join(checkpoints, step_dir_name(4)))
    assert "holds a model with num_hidden_layers 2 but model_path" in line and "has 3" in line


def test_export_dir_that_is_a_file(monkeypatch, capsys, ws, tmp_path):
    (tmp_path / "hf").write_text("not a folder")
    line = refused(monkeypatch, capsys, ws, "exportfile", export_dir=str(tmp_path / "hf"))
    assert f"export_dir '{tmp_path / 'hf'}' is an existing file, not a folder" in line


def test_save_dir_that_cannot_be_created(monkeypatch, capsys, ws, tmp_path):
    (tmp_path / "file").write_text("")
    line = refused(monkeypatch, capsys, ws, "savedir", save_dir=str(tmp_path / "file" / "ck"))
    assert f"save_dir '{tmp_path / 'file' / 'ck'}' cannot be created: '{tmp_path / 'file'}' is a file" in line


def test_lora_targets_that_name_no_projection(monkeypatch, capsys, ws):
    line = refused(monkeypatch, capsys, ws, "lora", use_lora=True, lora_target_modules=["q_proj", "v_proj"])
    assert ("lora_target_modules ['q_proj', 'v_proj'] names no projection of this bert model; its projections "
            "are dense, key, query, value") in line


def test_lora_targets_that_name_no_layer_of_a_pipeline(monkeypatch, capsys, ws):
    """Targets are checked on the whole model: a pipeline whose stages all lack them is refused
    before the rendezvous (one stage lacking them trains nothing there: docs/peft.md)."""
    config = write_config(ws, "lorapp", **outputs(ws, "lorapp"), use_lora=True,
                          lora_target_modules=["layer.9.attention.self.query"])
    code, _, line = run_entry(monkeypatch, capsys, config, "--world", "2", "--rank", "0",
                              script="pretrain_pp_bert.py", preset="pp")
    assert code == 2 and len(line.splitlines()) == 1 and line.startswith("pretrain_pp_bert.py: error: "), line
    assert ("lora_target_modules ['layer.9.attention.self.query'] names no projection of this bert model; its "
            "projections are dense, key, query, value") in line


# --- 2. the tokenizer ----------------------------------------------------------------------------

def test_model_folder_without_a_tokenizer(monkeypatch, capsys, ws):
    model = model_copy(ws, "m-notok", tokenizer=False)
    line = refused(monkeypatch, capsys, ws, "notok", model_path=model)
    assert f"model_path '{model}' has no tokenizer" in line and "tokenizer.json" in line


# --- 3. messages ---------------------------------------------------------------------------------

def test_unsupported_model_type_names_it_and_the_supported_ones(monkeypatch, capsys, ws):
    model = model_copy(ws, "m-xlnet", model_type="xlnet")
    line = refused(monkeypatch, capsys, ws, "xlnet", model_path=model)
    assert 'has model_type "xlnet" (string), which galaxy does not train' in line
    assert line.endswith(f"supported model types: {', '.join(sorted(FAMILIES))}")


def test_warmup_longer_than_the_run_warns(monkeypatch, capsys, ws):
    code, out, err = run_entry(monkeypatch, capsys, write_config(ws, "warmup", max_steps=3, warmup_steps=50,
                                                                 lr_schedule="linear"), "--check")
    assert code == 0
    assert err.splitlines() == [
        "pretrain_bert.py: warning: warmup_steps 50 is more than the 3 steps this run trains, so the learning "
        "rate never reaches learning_rate 0.001 (it ends at 6e-05); lower warmup_steps to at most 3"]


def test_resume_takes_step_n_unpadded(monkeypatch, capsys, ws, checkpoints):
    code, out, err = run_entry(monkeypatch, capsys, write_config(ws, "stepn", resume=os.path.join(checkpoints, "step-4")),
                               "--check")
    assert code == 0, err
    assert f"resuming from {os.path.join(checkpoints, step_dir_name(4))} (step 4)" in out
    line = refused(monkeypatch, capsys, ws, "stepn5", resume=os.path.join(checkpoints, "step-5"))
    assert "is not a folder" in line and f"{checkpoints} holds step-2, step-4" in line


@pytest.mark.parametrize("keys,expected", [
    ({"batch_streams": 5, "grad_accum_steps": 2},
     "batch_streams 5 exceeds the 4 rows of a micro-batch (batch_size 8 / dp_deg 1 / grad_accum_steps 2); use at "
     "most 4 streams or raise batch_size"),
    ({"batch_streams": 0}, "batch_streams must be at least 1, got 0")],
    ids=["more-streams-than-rows", "no-stream"])
def test_batch_streams_that_cannot_cut_the_micro_batch(monkeypatch, capsys, ws, keys, expected):
    assert refused(monkeypatch, capsys, ws, "streams", **keys) == f"pretrain_bert.py: error: {expected}"


@pytest.mark.parametrize("keys,expected", [
    ({"dp_sharding": "full", "batch_streams": 2},
     "batch_streams 2 cannot run under dp_sharding 'full' (FSDP2 gathers a layer's weights once per forward, "
     "not once per stream); set batch_streams to 1 or dp_sharding to 'none'"),
    ({"dp_batch_list": [6, 2], "batch_streams": 3},
     "batch_streams 3 exceeds the 2 rows of the smallest replica's micro-batch (dp_batch_list [6, 2] / "
     "grad_accum_steps 1); use at most 2 streams or give that replica more rows")],
    ids=["fsdp", "smallest-replica"])
def test_batch_streams_over_replicas_are_refused_before_the_rendezvous(monkeypatch, capsys, ws, keys, expected):
    config = write_config(ws, "streams-dp", dp_deg=2, **keys)
    code, _, err = run_entry(monkeypatch, capsys, config, "--world", "2", "--rank", "0",
                             script="pretrain_galaxy.py", preset="galaxy")
    assert code == 2 and "Traceback" not in err, err
    assert f"pretrain_galaxy.py: error: {expected}" == err.strip()


# --- 4. damaged checkpoints ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def damaged(ws, checkpoints):
    """A copy of the checkpoints whose newest has a truncated optimizer file."""
    save_dir = os.path.join(ws["root"], "ck-damaged")
    shutil.copytree(checkpoints, save_dir, symlinks=True)
    optimizer = os.path.join(save_dir, step_dir_name(4), "optimizer.safetensors")
    with open(optimizer, "r+b") as f:
        f.truncate(1000)
    return save_dir


def test_a_damaged_checkpoint_named_by_path_is_refused(monkeypatch, capsys, ws, damaged):
    line = refused(monkeypatch, capsys, ws, "damaged", resume=os.path.join(damaged, step_dir_name(4)))
    assert f"checkpoint {os.path.join(damaged, step_dir_name(4))} is damaged: optimizer.safetensors has 1,000 bytes, " \
           "the manifest says" in line


def test_latest_falls_back_to_the_newest_checkpoint_that_verifies(monkeypatch, capsys, dist_pool, ws, damaged):
    config = write_config(ws, "fallback", save_dir=damaged, resume="latest", num_epochs=2, max_steps=4)
    code, out, err = run_entry(monkeypatch, capsys, config, "--check")
    assert code == 0
    assert err.splitlines()[0].startswith(f"pretrain_bert.py: resume: {step_dir_name(4)} in {damaged} is damaged "
                                          "(optimizer.safetensors has 1,000 bytes, the manifest says")
    assert err.splitlines()[1] == f"pretrain_bert.py: resume: using {step_dir_name(2)}, the newest checkpoint that verifies"
    assert f"resuming from {os.path.join(damaged, step_dir_name(2))} (step 2)" in out
    dist_pool(1).run(train_on_rank, config)          # and the run itself resumes there
    assert sorted(step_losses(os.path.join(ws["root"], "fallback", "metrics.jsonl"))) == [3, 4]


# --- 7. --check ----------------------------------------------------------------------------------

def test_check_summarises_and_writes_nothing(monkeypatch, capsys, ws):
    paths = outputs(ws, "check")
    config = write_config(ws, "check", **paths, max_steps=3, use_lora=True)
    code, out, err = run_entry(monkeypatch, capsys, config, "--check")
    assert code == 0 and err == ""
    assert out.count("\n") == 1 and out.startswith("check: pretrain_bert.py would train bert (2 layers, hidden 48, ")
    assert "on 24 training examples in 6 classes (dev 12, test 12 held out): 3 steps of global batch 8 x 16" in out
    assert out.strip().endswith("Every check passed; nothing was run (no process group, no files written).")
    assert not any(os.path.exists(p) for p in paths.values())


def test_check_under_a_plan_names_the_shares(monkeypatch, capsys, ws):
    config = write_config(ws, "check-w2", tp_num_attention_heads_list=[4, 2], seq_scatter_list=[9, 7])
    code, out, _ = run_entry(monkeypatch, capsys, config, "--check", "--world", "2", "--rank", "1",
                             script="pretrain_galaxy.py", preset="galaxy")
    assert code == 0
    assert out.startswith("check: pretrain_galaxy.py (rank 1 of 2) would train")
    assert ("plan ATT TP / CON SP / MLP TP on world 2 = pp 1 x dp 1 x Galaxy group 2 (heads [4, 2], MLP columns "
            "[48, 48], tokens [9, 7])") in out


# dp_batch_list at world 2 (dp 2), batch_size 8: each mistake one line, before the process group.
BAD_ROWS = {
    "length": (dict(dp_batch_list=[8]), "dp_batch_list has 1 entries but dp_deg is 2; give one row count per "
                                        "replica"),
    "sum": (dict(dp_batch_list=[3, 3]), "dp_batch_list sums to 6 but batch_size is 8; make the entries add up to 8"),
    "zero": (dict(dp_batch_list=[8, 0]), "dp_batch_list[1] must be at least 1 (every rank needs a share), got 0"),
    "accumulation": (dict(dp_batch_list=[7, 1], grad_accum_steps=2),
                     "dp_batch_list[0] is 7, which does not split into grad_accum_steps 2 equal micro-batches; "
                     "give every replica a multiple of 2 rows or lower grad_accum_steps"),
    "dp1": (dict(dp_batch_list=[6, 2], dp_deg=1, pp_deg=2, num_microbatches=2),
            "dp_batch_list is set but dp_deg is 1: it splits each batch between data-parallel replicas; set "
            "dp_deg to its length or remove dp_batch_list"),
}


@pytest.mark.parametrize("case", BAD_ROWS)
def test_uneven_replica_rows_that_do_not_fit(monkeypatch, capsys, ws, case):
    keys, wanted = BAD_ROWS[case]
    config = write_config(ws, f"rows-{case}", **outputs(ws, f"rows-{case}"), **keys)
    code, _, line = run_entry(monkeypatch, capsys, config, "--world", "2", "--rank", "0",
                              script="pretrain_dp_bert.py", preset="dp")
    assert code == 2 and len(line.splitlines()) == 1 and line.startswith("pretrain_dp_bert.py: error: "), line
    assert wanted in line


def test_pipeline_warmups_that_rise_or_need_torchs_schedules(monkeypatch, capsys, ws):
    """A warm-up list that rises from one stage to the next would deadlock the pipeline: the plan
    refuses it. NCCL runs torch's schedules, whose warm-ups are fixed, and so does gloo under the
    benches' GALAXY_PP_ENGINE=torch: both refused before the process group (init_distributed itself
    runs here, the tripwire taken away)."""
    keys, real = dict(pp_deg=2, num_microbatches=4, **outputs(ws, "warmup")), launch.init_distributed
    code, _, line = run_entry(monkeypatch, capsys, write_config(ws, "warmup", pipeline_warmup_list=[1, 2], **keys),
                              "--world", "2", "--rank", "1", script="pretrain_galaxy.py", preset="galaxy")
    assert code == 2 and len(line.splitlines()) == 1 and line.startswith("pretrain_galaxy.py: error: "), line
    assert ("pipeline_warmup_list rises from stage 0 (1) to stage 1 (2); a stage may not wait for more forwards "
            "than the one before it sends ahead: make the list non-increasing") in line
    monkeypatch.setattr(launch, "init_distributed", real)

    def refusal(**extra) -> str:
        with pytest.raises(SystemExit) as exit_:
            launch.main(preset="galaxy", train_fn=train, script="pretrain_galaxy.py", prepare_fn=prepare_classifier,
                        argv=["--config_file", write_config(ws, "warmup", pipeline_warmup_list=[4, 1], **extra, **keys),
                              "--world", "2", "--rank", "1", "--init_method", "tcp://127.0.0.1:1"])
        assert exit_.value.code == 2 and not dist.is_initialized()
        return capsys.readouterr().err

    assert refusal(distributed_backend="nccl") == (
        "pretrain_galaxy.py: error: pipeline_warmup_list runs only on Galaxy's pipeline engine over gloo, but the "
        "backend is 'nccl'; set distributed_backend to 'gloo' or remove pipeline_warmup_list\n")
    monkeypatch.setenv("GALAXY_PP_ENGINE", "torch")     # the benches' switch to torch's schedules
    assert refusal() == (
        "pretrain_galaxy.py: error: pipeline_warmup_list runs only on Galaxy's pipeline engine over gloo, but "
        "GALAXY_PP_ENGINE=torch picks torch's schedules; unset GALAXY_PP_ENGINE or remove pipeline_warmup_list\n")


def test_a_mesh_rank_order_that_is_no_permutation(monkeypatch, capsys, ws):
    config = write_config(ws, "order", **outputs(ws, "order"), mesh_rank_order=[1, 1])
    code, _, line = run_entry(monkeypatch, capsys, config, "--world", "2", "--rank", "0",
                              script="pretrain_dp_bert.py", preset="dp")
    assert code == 2 and len(line.splitlines()) == 1, line
    assert line.strip() == ("pretrain_dp_bert.py: error: mesh_rank_order [1, 1] must hold every launch rank 0..1 "
                            "once (mesh position i is held by the process started as rank mesh_rank_order[i]); fix "
                            "the list or remove the key")


def test_check_names_the_mesh_position(monkeypatch, capsys, ws):
    config = write_config(ws, "check-order", mesh_rank_order=[1, 0])
    code, out, _ = run_entry(monkeypatch, capsys, config, "--check", "--world", "2", "--rank", "0",
                             script="pretrain_dp_bert.py", preset="dp")
    assert code == 0 and "pretrain_dp_bert.py (rank 0 of 2, mesh position 1) would train" in out, out


def test_check_names_the_rows_per_replica(monkeypatch, capsys, ws):
    config = write_config(ws, "check-rows", dp_batch_list=[6, 2], grad_accum_steps=2)
    code, out, _ = run_entry(monkeypatch, capsys, config, "--check", "--world", "2", "--rank", "1",
                             script="pretrain_dp_bert.py", preset="dp")
    assert code == 0 and "pp 1 x dp 2 x Galaxy group 1 (rows per replica [6, 2])" in out, out


def test_check_a_llama_run(monkeypatch, capsys, tmp_path):
    config = tmp_path / "llama.json"
    config.write_text(json.dumps({"model_path": "models/tiny-llama", "pad_size": 16, "batch_size": 4, "max_steps": 2}))
    code, out, _ = run_entry(monkeypatch, capsys, str(config), "--check", script="finetune_llama.py",
                             preset="galaxy", prepare=prepare_causal_lm)
    assert code == 0 and out.startswith("check: finetune_llama.py would train llama (4 layers, hidden 128")
