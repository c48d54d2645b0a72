"""Metrics: the peak-FLOP/s table and measurement, throughput/MFU, the progress line, metrics.jsonl,
TensorBoard and loss.png."""

from __future__ import annotations

import io
import json

import pytest
import torch

from meshlm.training.metrics import (MetricsLog, ProgressLine, Throughput, expert_load_summary, format_count,
                                     format_duration, measured_peak_flops, progress_text, read_metrics,
                                     table_peak_flops)
from meshlm.training.plots import loss_curves, plot_losses


@pytest.mark.parametrize("name, dtype, tf32, tflops, label", [
    ("NVIDIA H100 80GB HBM3", "bf16", False, 989.4, "H100 SXM"),
    ("NVIDIA H100 PCIe", "bf16", False, 756.0, "H100 PCIe"),
    ("NVIDIA H100 NVL", "fp16", False, 835.0, "H100 NVL"),
    ("NVIDIA H200", "bf16", False, 989.4, "H200 SXM"),
    ("NVIDIA A100-SXM4-80GB", "fp32", True, 156.0, "A100"),
    ("NVIDIA A100 80GB PCIe", "fp32", False, 19.5, "A100"),
    ("NVIDIA L40S", "bf16", False, 362.1, "L40S"),
    ("NVIDIA L4", "bf16", False, 121.0, "L4"),
])
def test_table_peak_for_known_gpus(name, dtype, tf32, tflops, label):
    peak, source = table_peak_flops(name, dtype, allow_tf32=tf32)
    assert peak == pytest.approx(tflops * 1e12)
    assert source.startswith(f"table: {label} ") and name in source


def test_unknown_gpu_is_not_in_the_table():
    assert table_peak_flops("Some Future Accelerator", "bf16", allow_tf32=False) is None


def test_measured_peak_is_a_plausible_cpu_rate_and_leaves_the_rng_alone():
    state = torch.get_rng_state()
    peak, source = measured_peak_flops("cpu", "fp32", sizes=(128, 256), repeats=1)
    assert 1e7 < peak < 1e14 and source.startswith("measured: best fp32")
    assert torch.equal(torch.get_rng_state(), state)


def test_throughput_and_mfu():
    throughput = Throughput(flops_per_token=1e6, peak=1e10)
    throughput.add(tokens=2000, seconds=0.5)
    throughput.add(tokens=2000, seconds=0.5)
    assert throughput.tokens_per_second() == 4000
    assert throughput.mfu(4000) == pytest.approx(0.4)
    throughput.reset()
    assert throughput.tokens_per_second() == 0.0


def test_expert_load_summary_over_blocks():
    counts = [torch.tensor([2, 2, 2, 2]), torch.tensor([6, 1, 1, 0])]  # second block: mean 2
    summary = expert_load_summary(counts)
    assert summary == {"moe_max_load": 3.0, "moe_min_load": 0.0, "moe_max_load_per_layer": [1.0, 3.0]}
    assert expert_load_summary([]) == {}


def test_formatting():
    assert [format_count(v) for v in (950, 5123, 2.5e6, 3e9)] == ["950", "5.1k", "2.5M", "3.0G"]
    assert [format_duration(s) for s in (7, 83, 4000, float("inf"))] == ["7s", "1m23s", "1h06m", "?"]
    record = {"step": 12, "loss": 4.1234, "lr": 2.9e-4, "tokens_per_s": 5100, "mfu": 0.412}
    assert progress_text(record, 100, 83) == "step 12/100 | loss 4.123 | lr 2.9e-04 | 5.1k tok/s | MFU 41.2% | ETA 1m23s"
    pairs = {**record, "reward_accuracy": 0.8125, "reward_margin": 0.4321, "skipped_steps": 1}
    assert progress_text(pairs, 100, 83) == ("step 12/100 | loss 4.123 | acc 0.81 | margin 0.432 | lr 2.9e-04 | "
                                             "skipped 1 | 5.1k tok/s | MFU 41.2% | ETA 1m23s")
    with_memory = {**record, "memory_peak_bytes": 1.25 * 2 ** 30, "memory_reserved_peak_bytes": 2 ** 31}
    assert progress_text(with_memory, 100, 83) == ("step 12/100 | loss 4.123 | lr 2.9e-04 | 5.1k tok/s | MFU 41.2% | "
                                                   "mem 1.25 GiB | ETA 1m23s")


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_line_redraws_on_a_terminal_and_prints_lines_otherwise():
    record = {"step": 1, "loss": 3.0, "lr": 1e-3, "tokens_per_s": 10.0, "mfu": 0.1}
    terminal, pipe = FakeTerminal(), io.StringIO()
    for stream in (terminal, pipe):
        progress = ProgressLine(total_steps=4, enabled=True, stream=stream)
        for step in (1, 2, 3, 4):
            progress.update(dict(record, step=step), logged=step % 2 == 0)
    assert terminal.getvalue().count("\r") == 4 and terminal.getvalue().count("\n") == 2
    assert "\r" not in pipe.getvalue()
    assert [line.split(" | ")[0] for line in pipe.getvalue().splitlines()] == ["step 2/4", "step 4/4"]
    quiet = FakeTerminal()
    ProgressLine(total_steps=4, enabled=False, stream=quiet).update(dict(record, step=1), logged=False)
    assert quiet.getvalue() == ""


def test_metrics_log_truncates_on_resume_and_writes_tensorboard(tmp_path):
    log = MetricsLog(tmp_path, resume_step=0, tensorboard=True)
    log.write({"event": "start", "step": 0})
    for step in (1, 2, 3, 4):
        log.write({"step": step, "loss": 5.0 - step})
    log.write({"step": 2, "val_loss": 3.5})
    log.close()
    (tmp_path / "metrics.jsonl").open("a").write('{"step": 5, "loss"')  # a line torn by a crash
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 6
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))

    resumed = MetricsLog(tmp_path, resume_step=2, tensorboard=False)
    resumed.write({"step": 3, "loss": 1.5})
    resumed.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert records == [{"event": "start", "step": 0}, {"step": 1, "loss": 4.0}, {"step": 2, "loss": 3.0},
                       {"step": 2, "val_loss": 3.5}, {"step": 3, "loss": 1.5}]
    assert all(json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines())


def test_a_fresh_run_starts_a_fresh_metrics_file(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 7, "loss": 1.0}\n')
    MetricsLog(tmp_path, resume_step=0, tensorboard=False).close()
    assert read_metrics(tmp_path / "metrics.jsonl") == []


def test_loss_plot(tmp_path):
    lines = [{"event": "start", "step": 0}, {"step": 2, "loss": 3.0}, {"step": 1, "loss": 4.0},
             {"step": 2, "val_loss": 3.2}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert loss_curves(lines) == ([(1, 4.0), (2, 3.0)], [(2, 3.2)])
    path = plot_losses(tmp_path)
    assert path == tmp_path / "loss.png" and path.read_bytes()[:4] == b"\x89PNG"
