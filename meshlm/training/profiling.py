"""``train.profile_steps=A:B``: a torch.profiler trace of training steps A to B (1-based, inclusive).

Every rank profiles the same steps (CPU activity always, CUDA kernels too on a GPU) and writes its
own Chrome trace, RUN_DIR/profile/rank{R}.json: open it in https://ui.perfetto.dev or
chrome://tracing to see, per thread and CUDA stream, where a step's time goes (forward, backward,
each collective, the optimizer), each step under a ``train_step_{N}`` range. Global rank 0 also
prints the operators that took the most self time over the profiled steps (torch's
``key_averages`` table, by self CUDA time on a GPU, self CPU time otherwise).

Pick steps after the first one or two: the first step pays for one-time work (allocator growth,
cuDNN / GEMM heuristics, ``train.compile``'s compilation) that later steps do not repeat. The
profiled steps run slower than the others (the profiler records every operator), and their
tokens/s in metrics.jsonl show it. A run resumed inside the range profiles the steps it still runs.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable

import torch

from meshlm.config import parse_profile_steps

PROFILE_DIR = "profile"
TOP_OPERATORS = 15


class StepProfiler:
    """Starts torch.profiler before step A and stops it after step B; ``steps=None``: never profiles."""

    def __init__(self, steps: str | None, run_dir: Path, rank: int, device: torch.device,
                 report: Callable[[str], None]):
        self.range = parse_profile_steps(steps) if steps else None
        self.path = Path(run_dir) / PROFILE_DIR / f"rank{rank}.json"
        self.device, self.report = device, report
        self.profiler = None

    @contextlib.contextmanager
    def step(self, step: int):
        """Around training step ``step`` (1-based): profiled when it lies in the range."""
        if self.range is None or not self.range[0] <= step <= self.range[1]:
            yield
            return
        if self.profiler is None:
            self.start()
        with torch.profiler.record_function(f"train_step_{step}"):
            yield
        if step == self.range[1]:
            self.stop()

    def start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities)
        self.profiler.__enter__()

    def stop(self) -> None:
        """Write the trace and report the top operators; also called when the run ends early."""
        if self.profiler is None:
            return
        profiler, self.profiler = self.profiler, None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        profiler.__exit__(None, None, None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(self.path))
        self.range = None  # done: later steps (or a second stop) profile nothing
        sort_by = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = profiler.key_averages().table(sort_by=sort_by, row_limit=TOP_OPERATORS)
        self.report(f"profile: Chrome trace of this rank in {self.path}; top {TOP_OPERATORS} operators by "
                    f"{sort_by.replace('_', ' ')}:\n{table}")


__all__ = ["PROFILE_DIR", "StepProfiler", "TOP_OPERATORS"]
