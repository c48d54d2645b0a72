"""``meshlm plot`` (meshlm/training/plot_cli.py): curves read back from metrics.jsonl, runs side by
side, tokens on the x axis across a resume that changed the batch, and one sentence for bad input."""

from __future__ import annotations

import json

import pytest

from meshlm.cli import main
from meshlm.training.plot_cli import build_panels, metric_curve, metric_names, run_labels, smoothed, tokens_at

START = {"event": "start", "step": 0, "tokens_per_step": 100}


def write_run(path, records):
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def history(scale: float = 1.0) -> list[dict]:
    steps = [{"step": step, "loss": scale * (5 - step / 10), "lr": 1e-3, "grad_norm": 1.0 / step,
              "memory_peak_bytes": step * 2 ** 30} for step in range(1, 11)]
    return [START, {"step": 0, "val_loss": 5.2 * scale}, *steps, {"step": 10, "val_loss": 4.3 * scale},
            {"event": "stopped", "step": 10, "loss": 99.0}]


def test_curves_take_a_steps_last_record_skip_events_and_non_finite_points():
    records = [START, {"step": 1, "loss": 3.0}, {"step": 2, "loss": float("nan")}, {"step": 3, "loss": 9.0},
               {"event": "rollback", "step": 2, "loss": 7.0}, {"step": 3, "loss": 2.5},
               {"step": 4, "memory_peak_bytes": 3 * 2 ** 30, "flag": True}]
    assert metric_curve(records, "loss") == [(1, 3.0), (3, 2.5)]  # the re-run step 3 wins, NaN left out
    assert metric_curve(records, "memory_peak_bytes") == [(4, 3.0)]  # in GiB
    assert metric_names(records) == ["loss", "memory_peak_bytes"]  # booleans and events are not metrics


def test_tokens_follow_each_spans_batch_across_a_resume():
    records = [START, {"event": "resume", "step": 10, "tokens_per_step": 200}]
    assert [tokens_at(step, records) for step in (5, 10, 15)] == [500, 1000, 2000]
    assert metric_curve([*records, {"step": 15, "loss": 1.0}], "loss", "tokens") == [(2000, 1.0)]


def test_smoothing_is_tensorboards_debiased_average_and_labels_stay_apart():
    assert smoothed([4.0, 4.0, 4.0], 0.9) == pytest.approx([4.0, 4.0, 4.0])
    values = smoothed([0.0, 10.0], 0.5)
    assert values[0] == 0.0 and values[1] == pytest.approx((0.5 * 0 * 0.5 + 0.5 * 10) / (1 - 0.25))
    assert run_labels(["runs/a", "other/a", "runs/b"]) == ["runs/a", "other/a", "b"]


def test_panels_overlay_the_runs_and_the_loss_panel_carries_validation(tmp_path):
    histories = [history(), history(2.0)]
    panels = build_panels(histories, ["one", "two"], ["loss", "grad_norm"], "step")
    assert [metric for metric, _ in panels] == ["loss", "grad_norm"]
    (label, points, validation), second = panels[0][1]
    assert label == "one" and len(points) == 10 and validation == [(0, 5.2), (10, 4.3)]
    assert second[2] == [(0, 10.4), (10, 8.6)]
    assert panels[1][1][0][2] == [] and panels[1][1][0][1][0] == (1, 1.0)


def test_the_command_writes_the_figure_lists_metrics_and_refuses_bad_input(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    first, second = write_run(tmp_path / "a", history()), write_run(tmp_path / "b", history(2.0))
    out = tmp_path / "compare.png"
    out.write_bytes(b"old figure")
    assert main(["plot", str(first), str(second), "--metric", "loss", "lr", "memory_peak_bytes", "--x", "tokens",
                 "--smooth", "0.6", "--log-y", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "wrote" in capsys.readouterr().out
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a", "b", "compare.png"]  # no temporary left
    assert main(["plot", str(first), "--list"]) == 0
    assert capsys.readouterr().out.strip() == "a: grad_norm, loss, lr, memory_peak_bytes, val_loss"
    for arguments, message in [
        ([str(tmp_path / "missing")], "missing is not a directory; pass run directories"),
        ([str(tmp_path)], f"{tmp_path} holds no metrics.jsonl"),
        ([str(first), "--metric", "reward_mean"], "--metric reward_mean: no run logged it; the runs' metrics are "
                                                  "grad_norm, loss, lr, memory_peak_bytes, val_loss."),
        ([str(first), "--smooth", "1"], "--smooth 1.0 must lie in [0, 1)"),
        ([str(first), "--out", "figure.jpg2"], "--out figure.jpg2: give a .png, .pdf or .svg file."),
    ]:
        assert main(["plot", *arguments]) == 2
        assert message in capsys.readouterr().err, arguments
