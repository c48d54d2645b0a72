"""One step under ``torch.profiler``, summed up: the operators that took the most device time and
the parts of the step (loss head, optimizer, attention) each with what it called. Shared by
``bench.gpu_throughput --profile`` (meshlm's step beside the plain loop's) and
``bench.low_precision --profile`` (an FP8 step beside a bf16 one)."""

from __future__ import annotations

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
    "gated_norm": ("_RecomputedGatedRMSNorm", "_RecomputedGatedRMSNormBackward"),
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


__all__ = ["PROFILE_REGIONS", "matches", "profile_step", "region_times"]
