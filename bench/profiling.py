"""One step under ``torch.profiler``, summed up: the operators that took the most device time and
the parts of the step (loss head, optimizer, attention) each with what it called. Shared by
``bench.gpu_throughput --profile`` (meshlm's step beside the plain loop's) and
``bench.low_precision --profile`` (an FP8 step beside a bf16 one).

Under ``train.compile`` most of a profile's names are Inductor's generated kernels
(``triton_poi_fused_..._36``), which say what they fuse but not what they read and write.
``save_inductor_code`` keeps the Python modules Inductor generated in the run -- every kernel's
source, the buffers it is called with and their sizes -- in one file, so that a profile taken on
a lent GPU can be read against them afterwards, on any machine."""

from __future__ import annotations

import gzip
import os
import tempfile
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType

from bench.timing import synchronize


def profile_step(step, device: torch.device, top: int) -> dict:
    """One more step under ``torch.profiler``: the ``top`` operators by their own time on the
    device (on a CPU, by their own CPU time), each with its milliseconds and calls, and the step's
    total -- where meshlm's step and the plain loop's differ, at a glance."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    synchronize(device)
    with profile(activities=activities) as profiler:
        step()
        synchronize(device)
    attribute = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    averages = profiler.key_averages()
    events = [event for event in averages if getattr(event, attribute, 0) > 0]
    events.sort(key=lambda event: getattr(event, attribute), reverse=True)
    total_ms = sum(getattr(event, attribute) for event in events) / 1e3
    inclusive = "device_time_total" if device.type == "cuda" else "cpu_time_total"
    return {"measured": attribute, "total_ms": round(total_ms, 2),
            "top": [{"name": event.key[:120], "ms": round(getattr(event, attribute) / 1e3, 3), "calls": event.count}
                    for event in events[:top]],
            "regions_ms": region_times(averages, inclusive)}


def region_times(averages, inclusive: str) -> dict[str, float]:
    """Milliseconds of each part of ``PROFILE_REGIONS``: the ``inclusive`` time of the events it
    marks, each with everything it called. A ``record_function`` range (``Optimizer.step#...``)
    appears twice in a GPU profile, as the CPU range, whose device time already holds the kernels
    it launched, and as its copy on the GPU's timeline (``gpu_user_annotation``); the copy is
    left out, or the optimizer would count twice."""
    regions = {}
    for event in averages:  # the step's parts, each with what it called
        if event.is_user_annotation and event.device_type == DeviceType.CUDA:
            continue
        part = next((name for name, marks in PROFILE_REGIONS.items() if any(matches(mark, event.key) for mark in marks)),
                    None)
        if part is not None:
            regions[part] = regions.get(part, 0.0) + getattr(event, inclusive, 0) / 1e3
    return {part: round(ms, 3) for part, ms in sorted(regions.items())}


PROFILE_REGIONS = {
    "loss_head": ("ChunkedLinearCrossEntropy", "ChunkedLinearCrossEntropyBackward", "aten::cross_entropy_loss",
                  "autograd::engine::evaluate_function: NllLossBackward*",
                  "autograd::engine::evaluate_function: LogSoftmaxBackward*"),
    "optimizer": ("Optimizer.step#*",),
    "attention": ("aten::_scaled_dot_product*",),
    "ssd_scan": ("_ChunkedScan", "_ChunkedScanBackward"),
    "mamba_conv": ("_CausalConvSiLU", "_CausalConvSiLUBackward"),
    "gated_norm": ("_SkipGatedRMSNorm", "_SkipGatedRMSNormBackward"),
}
"""Parts of a step whose time ``profile_step`` adds up, each event with everything it called
(``regions_ms``). A mark is an event's whole name, or its start when it ends in ``*``; no two marks
of a part may match events that nest in one another (an autograd function's backward, for one,
runs inside ``autograd::engine::evaluate_function: <name>Backward``, so the backward is named
exactly, once). The parts: meshlm's fused loss, forward and backward, against the plain loop's
cross-entropy and its backward (the plain loop's logits matmul is not in it: compare with the
``top`` matmuls); the optimizer step; the attention kernels forward and backward, whichever SDPA
picked; and a Mamba-2 block's SSD scan, causal conv and gated norm, forward and backward. Those
three are autograd functions: they are events of their own when eager, and compiled into the
block's graph (so absent here) under ``train.compile``."""


def matches(mark: str, key: str) -> bool:
    """Whether profiler event ``key`` is the one ``mark`` names (``PROFILE_REGIONS``)."""
    return key.startswith(mark[:-1]) if mark.endswith("*") else key == mark


def inductor_cache_dir() -> Path:
    """Where Inductor writes its generated modules in this process (``TORCHINDUCTOR_CACHE_DIR``, or
    its default under the temporary directory)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        return Path(cache_dir())
    except ImportError:  # older layouts: the documented variable, else Inductor's default
        default = Path(tempfile.gettempdir()) / f"torchinductor_{os.environ.get('USER', 'user')}"
        return Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR", default))


def save_inductor_code(path: Path, since: float, root: Path | None = None) -> int:
    """Write every graph module Inductor generated since ``since`` (a ``time.time()``) under
    ``root`` (default: this process's cache directory) into one gzip text file at ``path``, each
    headed by its file name, oldest first; returns how many. A graph module is a generated
    ``.py`` that defines ``call`` (the kernels in launch order, with the buffers they get); the
    kernels' own sources are in it. Written to a temporary name and renamed, so an interrupted
    write leaves no half file. A module Inductor took from its cache instead of generating is
    older than ``since`` and not included: give the run a fresh ``TORCHINDUCTOR_CACHE_DIR``."""
    root = root or inductor_cache_dir()
    modules = []
    for candidate in root.rglob("*.py") if root.is_dir() else ():
        try:
            modified = candidate.stat().st_mtime
            if modified >= since and "def call(" in candidate.read_text(errors="replace"):
                modules.append((modified, candidate))
        except OSError:  # removed while we looked
            continue
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with gzip.open(partial, "wt") as out:
        out.write(f"# Inductor's generated graph modules, {len(modules)} of them, from {root} "
                  f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, torch {torch.__version__})\n")
        for _, module in sorted(modules):
            out.write(f"\n# ===== {module.relative_to(root)}\n")
            out.write(module.read_text(errors="replace"))
    os.replace(partial, path)
    return len(modules)


__all__ = ["PROFILE_REGIONS", "inductor_cache_dir", "matches", "profile_step", "region_times", "save_inductor_code"]
