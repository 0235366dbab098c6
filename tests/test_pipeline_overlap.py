"""Galaxy's pipeline engine (galaxy.pipeline.overlap_schedule) against torch's schedules.

It must compute exactly what torch's Schedule1F1B / ScheduleGPipe compute (bit for bit: the same
computations in the same order, only the sends and receives move), and it must not wait for a
send before its next compute. Deeper warm-ups per stage (pipeline_warmup_list) move only when
each computation runs, so they too must match torch's 1F1B bit for bit. The tiny pipeline
(support.schedule_runners) carries a trained tensor and one without a gradient (side-tuning's
frozen stream); one case's first stage trains nothing and runs no backward.
"""
import pytest

from support.schedule_runners import computes_before_its_send_is_received, engines_agree, warmups_agree

from galaxy.pipeline.overlap_schedule import gpipe_order, one_f_one_b_order
from galaxy.pipeline.schedule import ENGINE_VARIABLE, schedule_class


@pytest.mark.parametrize("schedule,world,microbatches,frozen_first",
                         [("1f1b", 3, 4, False), ("gpipe", 3, 4, False), ("1f1b", 3, 3, True),
                          ("1f1b", 2, 5, False), ("gpipe", 2, 1, True)])
def test_engine_matches_torch_bit_for_bit(dist_pool, schedule, world, microbatches, frozen_first):
    reports = dist_pool(world).run(engines_agree, schedule, microbatches, frozen_first)
    assert all(r["equal"] for r in reports), reports
    assert reports[-1]["losses"] == microbatches
    assert reports[-1]["moved"]
    assert reports[0]["grads"] == [not frozen_first, not frozen_first, False, False]   # w trains, v never


@pytest.mark.parametrize("world,microbatches,warmups,frozen_first",
                         [(2, 5, [5, 1], False), (2, 4, [3, 3], False), (3, 5, [5, 3, 1], False),
                          (3, 5, [5, 5, 1], False), (3, 4, [3, 3, 3], False), (3, 4, [4, 2, 2], True)])
def test_deeper_warmups_match_torch_bit_for_bit(dist_pool, world, microbatches, warmups, frozen_first):
    reports = dist_pool(world).run(warmups_agree, microbatches, warmups, frozen_first)
    assert all(r["equal"] for r in reports), reports
    assert reports[-1]["losses"] == microbatches
    for stage, (report, w) in enumerate(zip(reports, warmups)):
        ran = report["ran"]
        assert ran.index(("B", 0)) == w, (stage, ran)       # w forwards, then the first backward
        assert ran == one_f_one_b_order(microbatches, world, stage, w)
        forwards, backwards = ([i for kind, i in ran if kind == k] for k in "FB")
        assert forwards == backwards == list(range(microbatches))


@pytest.mark.parametrize("engine,expected", [("galaxy", True), ("torch", False)])
def test_next_forward_does_not_wait_for_a_send(dist_pool, tmp_path, engine, expected):
    """The last stage's gradient for micro-batch 0 is received late: Galaxy's engine computes the
    next forward anyway; torch's 1F1B waits for that send first (which shows the test can fail:
    a short patience, so its case takes about 0.5 s)."""
    patience = 20.0 if expected else 0.5
    first, _ = dist_pool(2).run(computes_before_its_send_is_received, engine, str(tmp_path), patience)
    assert first is expected


def test_orders_are_torchs():
    """Torch's 1F1B order: pp - stage warm-up forwards, then alternate, then drain."""
    assert one_f_one_b_order(4, 2, 0) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3),
                                          ("B", 2), ("B", 3)]
    assert one_f_one_b_order(3, 3, 2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]
    assert one_f_one_b_order(1, 1, 0) == [("F", 0), ("B", 0)]
    assert gpipe_order(2, 3, 1) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]


def test_warmup_order_interleaves_after_the_warmup():
    """Warm-up w: w forwards, then B0, F(w), B1, F(w+1), ..., then the remaining backwards."""
    assert one_f_one_b_order(5, 2, 0, 4) == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("F", 4),
                                             ("B", 1), ("B", 2), ("B", 3), ("B", 4)]
    assert one_f_one_b_order(3, 3, 2, 3) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("B", 1), ("B", 2)]
    assert one_f_one_b_order(4, 2, 1, None) == one_f_one_b_order(4, 2, 1, 1)


@pytest.mark.parametrize("name,backend,engine", [("1f1b", "nccl", "galaxy"), ("1f1b", "gloo", "torch"),
                                                 ("gpipe", "gloo", "galaxy")])
def test_warmups_refused_where_torchs_schedules_run(monkeypatch, name, backend, engine):
    monkeypatch.setenv(ENGINE_VARIABLE, engine)
    assert schedule_class(name, backend) is not None
    with pytest.raises(ValueError, match="pipeline_warmup_list needs Galaxy's 1f1b engine .* remove "
                                         "pipeline_warmup_list"):
        schedule_class(name, backend, (2, 1))
    monkeypatch.setenv(ENGINE_VARIABLE, "galaxy")
    assert schedule_class("1f1b", "gloo", (2, 1)).__name__ == "Overlapped1F1B"
