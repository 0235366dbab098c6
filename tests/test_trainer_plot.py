"""Metrics files across resumes, and the plot drawn from them."""
from galaxy.train.metrics import MetricsWriter, current_run
from galaxy.train.plot import plot_metrics, plot_path_for


def step(k, loss):
    return {"step": k, "loss": loss, "lr": 0.1, "tokens": 10, "time_s": 0.1}


def test_current_run_follows_fresh_starts_and_resumes():
    old = [{"event": "start", "step": 0, "resumed_from": None}, step(1, 9.0), {"event": "done"}]
    crashed = [{"event": "start", "step": 0, "resumed_from": None}, step(1, 2.0), step(2, 1.9),
               {"event": "eval", "step": 2, "loss": 1.8, "accuracy": 0.5}, step(3, 1.7)]
    resumed = [{"event": "start", "step": 2, "resumed_from": "ck/step-2"}, step(3, 1.6), step(4, 1.5)]
    kept = current_run(old + crashed + resumed)
    assert [r["loss"] for r in kept if "event" not in r] == [2.0, 1.9, 1.6, 1.5]    # one value per step
    assert [r["step"] for r in kept if r.get("event") == "eval"] == [2]


def test_plot_is_a_png_next_to_the_metrics_file(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    with MetricsWriter(path) as w:
        w.log_event("start", step=0, resumed_from=None)
        for k in range(1, 41):
            w.log_step(k, 2.0 / k, 0.1, 100, 0.5)
            if k % 20 == 0:
                w.log_event("eval", step=k, loss=1.0, accuracy=0.3 + k / 100)
        w.log_event("test", step=40, loss=1.0, accuracy=0.65)
    out = plot_metrics(str(path), chance=1 / 6)
    assert out == plot_path_for(str(path)) == str(tmp_path / "run" / "metrics.png")
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_a_run_without_evaluations_or_classes_plots_its_loss(tmp_path):
    """A causal-LM or seq2seq run (no class list, no dev set), as the LM scripts draw it: the
    entry-script and pool tests run with matplotlib hidden, so this one draws that case."""
    path = tmp_path / "lm" / "metrics.jsonl"
    with MetricsWriter(path) as w:
        w.log_event("start", step=0, resumed_from=None)
        for k in range(1, 4):
            w.log_step(k, 5.0 - k, 0.1, 100, 0.5)
    with open(plot_metrics(str(path)), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
