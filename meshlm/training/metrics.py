"""What a training run reports: throughput, MFU, a progress line, metrics.jsonl and TensorBoard.

**Model FLOPs utilization** (MFU, Chowdhery et al. 2022, "PaLM", appendix B) is the fraction of
the hardware's peak that the model's own arithmetic would use at the measured speed:

    MFU = model_flops_per_token(config, seq_len) * tokens_per_second / peak_flops_per_second

The numerator is defined once in ``meshlm.models.flops`` (matmuls only, backward = 2 x forward,
recomputation not counted). The denominator is the *dense* peak of the math the run actually
uses: on a known NVIDIA GPU it comes from the vendor's data sheet (bf16/fp16 tensor cores for
bf16/fp16 runs; TF32 tensor cores for fp32 runs when PyTorch allows TF32 matmuls, plain FP32
otherwise). On a CPU, or a GPU missing from the table, there is no trustworthy sheet, so we
time a few large matmuls in the run's dtype at start-up and take the best rate: MFU then says
how close the model's matmuls come to the best matmul this machine does. The peak and where it
came from are written once into the run's metrics header, so every MFU number can be checked.

**metrics.jsonl** holds one JSON object per line: a header ``{"event": "start", ...}`` each time
the trainer starts (or resumes), one object per logged step (``step``, ``loss``, ``lr``,
``grad_norm``, ``tokens_per_s``, ``mfu``, ``loss_scale``, ``skipped_steps`` and each loss term),
the peak memory of the process so far (``memory_peak_bytes``: allocated tensors on CUDA, with
``memory_reserved_peak_bytes`` beside it; resident memory on a CPU; ``memory_usage.py``); MoE runs
add the expert load: ``moe_max_load`` / ``moe_min_load`` (busiest and idlest expert over
the mean, over all MoE blocks) and ``moe_max_load_per_layer`` (max/mean per block); then
``{"step": N, "val_loss": ...}`` after each evaluation. On resume the lines past the resumed
step are dropped, so the file always describes one consistent history. TensorBoard gets the
same scalars when the ``tensorboard`` package is installed (it is optional), and so does a
Weights & Biases run with ``train.wandb=true`` (``meshlm/training/tracking.py``).
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import TextIO

import torch

from meshlm.errors import ConfigError
from meshlm.training.memory_usage import format_bytes
from meshlm.training.tracking import scalar_items

METRICS_FILE = "metrics.jsonl"
EVALUATIONS_FILE = "evaluations.jsonl"
"""Beside metrics.jsonl: each checkpoint's benchmark figures by step, written by `meshlm eval RUN
--every-checkpoint` (meshlm/evaluation/checkpoint_series.py) and drawn by `meshlm plot`."""
TENSORBOARD_DIR = "tensorboard"

# Dense (no 2:4 sparsity) peak TFLOP/s from NVIDIA's data sheets:
# (tokens that must all appear in the device name, label, bf16/fp16 tensor, tf32 tensor, plain fp32).
# More specific entries come first (an "H100 PCIe" must not match the plain "H100" line).
GPU_PEAK_TFLOPS = (
    (("H100", "PCIE"), "H100 PCIe", 756.0, 378.0, 51.2),
    (("H100", "NVL"), "H100 NVL", 835.0, 418.0, 60.0),
    (("H100",), "H100 SXM", 989.4, 494.7, 66.9),
    (("H200", "NVL"), "H200 NVL", 835.0, 418.0, 60.0),
    (("GH200",), "GH200", 989.4, 494.7, 66.9),
    (("H200",), "H200 SXM", 989.4, 494.7, 66.9),
    (("B200",), "B200", 2250.0, 1100.0, 80.0),
    (("A100",), "A100", 312.0, 156.0, 19.5),
    (("L40S",), "L40S", 362.1, 183.0, 91.6),
    (("L40",), "L40", 181.0, 90.5, 90.5),
    (("L4",), "L4", 121.0, 60.0, 30.3),
    (("A10",), "A10", 125.0, 62.5, 31.2),
)

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# --- the hardware peak ------------------------------------------------------------------------------
def table_peak_flops(device_name: str, dtype: str, allow_tf32: bool) -> tuple[float, str] | None:
    """Data-sheet peak for a GPU named ``device_name`` running ``dtype`` math, or None if unknown."""
    tokens = set(re.split(r"[^A-Z0-9]+", device_name.upper()))
    for required, label, low_precision, tf32, fp32 in GPU_PEAK_TFLOPS:
        if all(token in tokens for token in required):
            if dtype in ("bf16", "fp16"):
                return low_precision * 1e12, f"table: {label} dense {dtype} ({device_name})"
            if allow_tf32:
                return tf32 * 1e12, f"table: {label} dense tf32 ({device_name})"
            return fp32 * 1e12, f"table: {label} fp32 without tensor cores ({device_name})"
    return None


@functools.lru_cache(maxsize=None)
def measured_peak_flops(device: str, dtype: str, sizes: tuple[int, ...] = (256, 512, 1024, 2048),
                        repeats: int = 2, budget_seconds: float = 2.0) -> tuple[float, str]:
    """Best FLOP/s of square ``dtype`` matmuls on ``device`` (measured once per process).

    Sizes grow until the next one would overrun ``budget_seconds``: a dtype without fast CPU
    kernels (fp16 on many CPUs runs at a few GFLOP/s) stops at a small size instead of taking
    minutes.
    """
    torch_device, torch_dtype = torch.device(device), TORCH_DTYPES[dtype]
    generator = torch.Generator().manual_seed(0)  # never touches the global RNG the run relies on
    best, best_size, spent = 0.0, sizes[0], 0.0
    for index, size in enumerate(sizes):
        a = torch.randn(size, size, generator=generator).to(torch_device, torch_dtype)
        b = torch.randn(size, size, generator=generator).to(torch_device, torch_dtype)
        fastest = math.inf
        for attempt in range(repeats + 1):  # attempt 0 warms up (thread pools, kernel selection)
            _synchronize(torch_device)
            start = time.perf_counter()
            torch.matmul(a, b)
            _synchronize(torch_device)
            seconds = time.perf_counter() - start
            spent += seconds
            if attempt > 0:
                fastest = min(fastest, seconds)
        if 2 * size ** 3 / max(fastest, 1e-9) > best:
            best, best_size = 2 * size ** 3 / max(fastest, 1e-9), size
        next_size = sizes[index + 1] if index + 1 < len(sizes) else None
        if next_size and spent + (repeats + 1) * fastest * (next_size / size) ** 3 > budget_seconds:
            break
    return best, f"measured: best {dtype} {best_size}x{best_size} matmul on {device}"


def peak_flops(device: torch.device, dtype: str) -> tuple[float, str]:
    """The peak FLOP/s that MFU divides by, and a sentence saying where it came from."""
    if device.type == "cuda":
        found = table_peak_flops(torch.cuda.get_device_name(device), dtype,
                                 torch.backends.cuda.matmul.allow_tf32)
        if found is not None:
            return found
    return measured_peak_flops(str(device), dtype)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- throughput ---------------------------------------------------------------------------------------
class Throughput:
    """Tokens per second and MFU over the steps since the last report.

    Only time spent inside training steps is counted (the trainer passes each step's duration),
    so evaluations and checkpoint saves do not drag the number down.
    """

    def __init__(self, flops_per_token: float, peak: float):
        self.flops_per_token, self.peak = flops_per_token, peak
        self.reset()

    def reset(self) -> None:
        self.tokens, self.seconds = 0, 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens += tokens
        self.seconds += seconds

    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def mfu(self, tokens_per_second: float) -> float:
        return self.flops_per_token * tokens_per_second / self.peak if self.peak > 0 else 0.0


def expert_load_summary(tokens_per_expert: list[torch.Tensor]) -> dict[str, float | list[float]]:
    """Load imbalance of MoE routing: the busiest and idlest expert over the mean (1.0 = balanced).

    ``tokens_per_expert`` holds, per MoE block, the assignments each expert received this step.
    ``moe_max_load`` / ``moe_min_load`` are over all blocks; ``moe_max_load_per_layer`` lists
    max/mean tokens per expert of each MoE block in order (the imbalance of each layer).
    """
    if not tokens_per_expert:
        return {}
    loads = torch.stack([counts.float() / counts.float().mean().clamp(min=1e-9) for counts in tokens_per_expert])
    return {"moe_max_load": loads.max().item(), "moe_min_load": loads.min().item(),
            "moe_max_load_per_layer": loads.max(dim=1).values.tolist()}


# --- the progress line -----------------------------------------------------------------------------------
def format_count(value: float) -> str:
    """5123 -> '5.1k', 2.5e6 -> '2.5M'."""
    for threshold, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= threshold:
            return f"{value / threshold:.1f}{suffix}"
    return f"{value:.0f}"


def format_duration(seconds: float) -> str:
    """83 -> '1m23s', 4000 -> '1h06m'."""
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


PROGRESS_EXTRAS = (("reward_accuracy", "acc {:.2f}"), ("reward_margin", "margin {:.3f}"),
                   ("score_margin", "margin {:.3f}"))
"""Measurements some objectives log beside the loss (preference pairs: the share ranked right and
the mean margin), shown after it on the progress line when the record has them."""


def progress_text(record: dict, total_steps: int, eta_seconds: float) -> str:
    """``step 12/100 | loss 4.123 | lr 2.9e-04 | 5.1k tok/s | MFU 41.2% | mem 1.2 GiB | ETA 1m23s``
    (``mem``: the process's peak so far, memory_usage.py; left out where it is not known)."""
    extras = [form.format(record[key]) for key, form in PROGRESS_EXTRAS if key in record]
    memory = [f"mem {format_bytes(record['memory_peak_bytes'])}"] if "memory_peak_bytes" in record else []
    parts = [f"step {record['step']}/{total_steps}", f"loss {record['loss']:.3f}", *extras, f"lr {record['lr']:.1e}",
             f"{format_count(record['tokens_per_s'])} tok/s", f"MFU {100 * record['mfu']:.1f}%", *memory,
             f"ETA {format_duration(eta_seconds)}"]
    if record.get("skipped_steps"):
        parts.insert(3 + len(extras), f"skipped {record['skipped_steps']}")
    return " | ".join(parts)


class ProgressLine:
    """A ``\\r``-updated line on a terminal; on a pipe or log file, one printed line per report."""

    def __init__(self, total_steps: int, enabled: bool, stream: TextIO | None = None):
        self.stream = stream or sys.stderr
        self.total_steps = total_steps
        self.live = enabled and _is_terminal(self.stream)
        self.first_step, self.first_time = None, 0.0

    def eta(self, step: int) -> float:
        """Seconds left, from the mean step time since the first step this process ran."""
        if self.first_step is None:
            self.first_step, self.first_time = step, time.perf_counter()
        if step <= self.first_step:
            return math.inf
        per_step = (time.perf_counter() - self.first_time) / (step - self.first_step)
        return per_step * (self.total_steps - step)

    def update(self, record: dict, logged: bool) -> None:
        """Redraw the live line every step; print a permanent line on logged steps."""
        text = progress_text(record, self.total_steps, self.eta(record["step"]))
        if self.live:
            self.stream.write("\r\033[K" + text + ("\n" if logged else ""))
        elif logged:
            self.stream.write(text + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        """A line of its own (evaluation results, checkpoints), not overwritten by the live line."""
        self.stream.write(("\r\033[K" if self.live else "") + text + "\n")
        self.stream.flush()


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


# --- metrics.jsonl, TensorBoard and W&B -------------------------------------------------------------------
def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Every JSON object of a metrics.jsonl file (a torn last line, from a crash, is skipped)."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def run_metrics_file(run_dir: str | os.PathLike) -> Path:
    """RUN_DIR/metrics.jsonl of a run directory a command was given; ConfigError when there is none."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        what = "is not a directory" if not Path(run_dir).is_dir() else f"holds no {METRICS_FILE}"
        raise ConfigError(f"{run_dir} {what}; pass run directories (a run's train.run_dir, where the trainer "
                          f"writes {METRICS_FILE}).")
    return path


def metric_word(text: str) -> str:
    """``text`` as one word of a metric name: each run of other characters than letters and digits
    becomes '_' ('web-2024.v1' -> 'web_2024_v1'); 'data' when nothing is left."""
    return re.sub(r"[^0-9A-Za-z]+", "_", text).strip("_") or "data"


def truncate_metrics(path: Path, last_step: int) -> None:
    """Keep only the lines of steps <= ``last_step`` (rewritten atomically)."""
    kept = [record for record in read_metrics(path) if record.get("step", 0) <= last_step]
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text("".join(json.dumps(record) + "\n" for record in kept))
    os.replace(temporary, path)


class SilentLog:
    """Stands in for ``MetricsLog`` and ``ProgressLine`` on every rank but global rank 0, which
    alone prints and writes the run's files."""

    tensorboard_enabled = False

    def write(self, record: dict) -> None:
        pass

    def update(self, record: dict, logged: bool) -> None:
        pass

    def message(self, text: str) -> None:
        pass

    def close(self, plot: Path | None = None) -> None:
        pass


class MetricsLog:
    """Appends records to RUN_DIR/metrics.jsonl and mirrors their numbers to TensorBoard and to a
    tracker (``tracking.WandbTracker``), when given one."""

    def __init__(self, run_dir: Path, resume_step: int, tensorboard: bool, tracker=None):
        self.path = Path(run_dir) / METRICS_FILE
        if resume_step > 0:
            truncate_metrics(self.path, resume_step)
        else:
            self.path.unlink(missing_ok=True)  # a fresh run (no checkpoint) starts a fresh history
        self.file = self.path.open("a")
        self.writer = _tensorboard_writer(Path(run_dir) / TENSORBOARD_DIR, resume_step) if tensorboard else None
        self.tracker = tracker
        self.last_step = resume_step

    @property
    def tensorboard_enabled(self) -> bool:
        return self.writer is not None

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if "step" not in record or record.get("event") is not None:
            return  # the start header and events (rollback, stopped) carry no curves
        self.last_step = record["step"]
        if self.writer is not None:
            for tag, value in scalar_items(record).items():
                self.writer.add_scalar(tag, value, record["step"])
        if self.tracker is not None:
            self.tracker.log(record)

    def close(self, plot: Path | None = None) -> None:
        """Close the files and the tracker; ``plot`` (RUN_DIR/loss.png, if drawn) goes to the tracker last."""
        self.file.close()
        if self.writer is not None:
            self.writer.close()
        if self.tracker is not None:
            if plot is not None:
                self.tracker.log_image("plots/loss", plot, self.last_step)
            self.tracker.close()


def _tensorboard_writer(log_dir: Path, resume_step: int):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is an optional dependency
        return None
    # purge_step hides events a crashed run wrote past the step we resume from.
    return SummaryWriter(str(log_dir), purge_step=resume_step + 1 if resume_step > 0 else None)


__all__ = ["EVALUATIONS_FILE", "GPU_PEAK_TFLOPS", "METRICS_FILE", "MetricsLog", "ProgressLine", "SilentLog",
           "Throughput", "expert_load_summary", "format_count", "format_duration", "measured_peak_flops", "metric_word",
           "peak_flops", "progress_text", "read_metrics", "run_metrics_file", "table_peak_flops", "truncate_metrics"]
