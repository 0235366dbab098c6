"""Learning-rate schedules and the training config keys: values and one-line errors."""
import json
import math

import pytest

from galaxy.config import ConfigError, load_config
from galaxy.train.schedule import LRSchedule


def lrs(kind, warmup, total, base=1.0):
    s = LRSchedule(kind, base, warmup, total)
    return [s.lr(k) for k in range(1, total + 1)]


def test_warmup_is_linear_and_starts_above_zero():
    assert lrs("constant", 4, 6) == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_linear_decay_never_wastes_a_step():
    # after 2 warm-up steps: 4 steps at 1, 3/4, 1/2, 1/4 -- the first at base_lr, the last above 0
    assert lrs("linear", 2, 6) == [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]


def test_cosine_follows_half_a_cosine():
    got = lrs("cosine", 0, 4, base=2.0)
    want = [2.0 * 0.5 * (1 + math.cos(math.pi * p)) for p in (0, 0.25, 0.5, 0.75)]
    assert got == pytest.approx(want, abs=1e-12)
    assert got[0] == 2.0 and got[-1] > 0


def test_apply_sets_every_group():
    class Opt:
        param_groups = [{"lr": 0.0}, {"lr": 0.0}]
    assert LRSchedule("linear", 0.1, 0, 10).apply(Opt, 1) == 0.1
    assert [g["lr"] for g in Opt.param_groups] == [0.1, 0.1]


@pytest.fixture
def load(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")

    def _load(**keys):
        path = tmp_path / "c.json"
        path.write_text(json.dumps({"model_path": str(tmp_path / "model"), **keys}))
        return load_config(path)
    return _load


def error_of(load, **keys) -> str:
    with pytest.raises(ConfigError) as info:
        load(**keys)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_training_key_defaults(load):
    cfg = load()
    assert (cfg.lr_schedule, cfg.warmup_steps, cfg.clip_grad, cfg.grad_accum_steps, cfg.mixed_precision) == \
        ("constant", 0, None, 1, "none")
    assert (cfg.eval_interval, cfg.save_dir, cfg.save_interval, cfg.resume, cfg.export_dir) == (None,) * 5
    assert load(mixed_precision=None).mixed_precision == "none"


def test_training_key_errors_name_the_key(load, tmp_path):
    assert "lr_schedule" in error_of(load, lr_schedule="step")
    assert "warmup_steps" in error_of(load, warmup_steps=-1)
    assert "clip_grad" in error_of(load, clip_grad=0)
    assert "grad_accum_steps" in error_of(load, batch_size=8, grad_accum_steps=3)
    assert "'bf16'" in error_of(load, mixed_precision="fp16")
    assert "eval_interval" in error_of(load, eval_interval=0)
    assert "save_dir" in error_of(load, save_interval=10)
    assert "save_dir" in error_of(load, resume="latest")
    assert "resume" in error_of(load, resume=str(tmp_path / "nowhere"))


def test_paths_become_absolute(load, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load(save_dir="ck", export_dir="out", resume="model")
    assert (cfg.save_dir, cfg.export_dir, cfg.resume) == \
        (str(tmp_path / "ck"), str(tmp_path / "out"), str(tmp_path / "model"))
