"""The peak of the bytes torch allocates while a function runs, from the profiler's allocation timeline.

Host memory counters (VmHWM) see the interpreter, the allocator's caching and other threads; this
counts only tensor storage (and can sum what was ever allocated): every CREATE and DESTROY the profiler records (``profile_memory``),
in time order, above what was allocated before. A test uses it to bound what a piece of code
holds at once (e.g. sharded construction: a rank's shards plus one full tensor).
"""

from __future__ import annotations

from torch.profiler import ProfilerActivity, profile


def peak_allocated_bytes(function) -> int:
    """The most bytes torch held allocated (on the CPU) at once while ``function`` ran."""
    return allocation_profile(function)[0]


def allocation_profile(function) -> tuple[int, int]:
    """(peak bytes held at once, total bytes ever allocated) by torch on the CPU while ``function`` ran."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as profiler:
        result = function()
    live = before = peak = total = 0
    for _, action, _, size in profiler._memory_profile().timeline:
        if action.name == "PREEXISTING":  # allocated before: counted, and the peak is taken above them
            before += size
        live += {"PREEXISTING": size, "CREATE": size, "DESTROY": -size}.get(action.name, 0)
        total += size if action.name == "CREATE" else 0
        peak = max(peak, live)
    del result
    return peak - before, total


__all__ = ["allocation_profile", "peak_allocated_bytes"]
