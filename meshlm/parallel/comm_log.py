"""Count what a stretch of code sends between ranks: calls and bytes per collective and group.

    with record_communication(labels={"tp": context.tp_group, "dp": context.dp_group}) as log:
        trainer.train_step(...)
    print(log.summary())

For the duration of the ``with`` block the ``torch.distributed`` collectives (``all_reduce``,
``all_gather_single`` / ``all_gather_into_tensor`` / ``all_gather``, ``reduce_scatter_single`` /
``reduce_scatter_tensor`` / ``reduce_scatter``, ``all_to_all_single`` / ``all_to_all``,
``broadcast``) are replaced on the ``torch.distributed`` module by wrappers that count each call
of *this* rank, then call the original. Code that calls them as ``dist.<name>`` at call time --
``meshlm.parallel.plain_collectives``, through which all of meshlm communicates -- is counted; a name imported
before the block (``from torch.distributed import all_reduce``), torch's own internal calls and
the traceable ``_functional_collectives`` are not. A collective that calls another counts once.

Bytes convention. ``bytes`` is the size of the *whole* tensor the collective works on, the
"message size" of nccl-tests:

    all_reduce      the tensor                     ring: each rank sends 2 (n-1)/n x bytes
    all_gather      the gathered output            ring: (n-1)/n x bytes
    reduce_scatter  the full input (before scatter) ring: (n-1)/n x bytes
    all_to_all      this rank's input              (n-1)/n x bytes leave the rank
    broadcast       the tensor                     a pipelined chain: about 1 x bytes

``ring_bytes_sent`` applies those factors (n = the group's size): the traffic a bandwidth-optimal
algorithm puts on each rank's link, which is what to compare with a link's bandwidth. It shows
why sequence parallelism is free in bytes (Korthikanti et al. 2022): the reduce-scatter plus
all-gather that replace one all-reduce of the same tensor send (n-1)/n + (n-1)/n = 2 (n-1)/n.
"""

from __future__ import annotations

import functools
import inspect
import threading
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

COUNTED = {
    # torch.distributed name: (kind, the argument whose size is the message size)
    "all_reduce": ("all_reduce", "tensor"),
    "all_gather_single": ("all_gather", "output_tensor"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "all_gather": ("all_gather", "tensor_list"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "reduce_scatter": ("reduce_scatter", "input_list"),
    "all_to_all_single": ("all_to_all", "input"),
    "all_to_all": ("all_to_all", "input_tensor_list"),
    "broadcast": ("broadcast", "tensor"),
}

RING_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0 if n > 1 else 0.0,
}


@dataclass
class CollectiveCount:
    calls: int = 0
    bytes: int = 0
    """Summed message sizes (see the module docstring)."""
    group_size: int = 1
    kind: str = ""

    @property
    def ring_bytes_sent(self) -> float:
        """Bytes each rank of the group sends with a bandwidth-optimal (ring) algorithm."""
        return RING_FACTOR[self.kind](self.group_size) * self.bytes


class CommunicationLog:
    """Counts by (kind, group label); a group's label comes from ``labels``, else 'world' for the
    default group, else the tuple of its global ranks."""

    def __init__(self, labels: dict[str, object] | None = None):
        """``labels``: name -> ``Group`` (or raw ``ProcessGroup``); None values are skipped."""
        self.labels = {name: getattr(group, "process_group", group) for name, group in (labels or {}).items()
                       if group is not None}
        self.counts: dict[tuple[str, str], CollectiveCount] = {}

    def label_of(self, group) -> str:
        for name, labelled in self.labels.items():
            if group is labelled:
                return name
        if group is None or group is dist.group.WORLD:
            return "world"
        return str(tuple(dist.get_process_group_ranks(group)))

    def add(self, kind: str, group, size_bytes: int) -> None:
        key = (kind, self.label_of(group))
        count = self.counts.setdefault(key, CollectiveCount(kind=kind, group_size=dist.get_world_size(group)))
        count.calls += 1
        count.bytes += size_bytes

    @property
    def total_ring_bytes_sent(self) -> float:
        return sum(count.ring_bytes_sent for count in self.counts.values())

    def summary(self) -> str:
        lines = [f"{'collective':<16}{'group':<14}{'calls':>7}{'MB':>12}{'ring MB sent':>14}"]
        for (kind, label), count in sorted(self.counts.items()):
            lines.append(f"{kind:<16}{label:<14}{count.calls:>7}{count.bytes / 1e6:>12.3f}"
                         f"{count.ring_bytes_sent / 1e6:>14.3f}")
        return "\n".join(lines)


def _size_in_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return sum(_size_in_bytes(item) for item in value)


_active_logs: list[CommunicationLog] = []
_originals: dict[str, object] = {}
_inside = threading.local()


def _counting(name: str, original):
    kind, sized_argument = COUNTED[name]
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if getattr(_inside, "depth", 0) == 0:
            arguments = signature.bind(*args, **kwargs).arguments
            for log in _active_logs:
                log.add(kind, arguments.get("group"), _size_in_bytes(arguments[sized_argument]))
        _inside.depth = getattr(_inside, "depth", 0) + 1
        try:
            return original(*args, **kwargs)
        finally:
            _inside.depth -= 1

    return wrapper


@contextmanager
def record_communication(labels: dict[str, object] | None = None):
    """Count this rank's collectives inside the block; yields the ``CommunicationLog``. Blocks
    may nest (each log counts what runs inside it)."""
    log = CommunicationLog(labels)
    if not _active_logs:
        for name in COUNTED:
            if hasattr(dist, name):
                _originals[name] = getattr(dist, name)
                setattr(dist, name, _counting(name, _originals[name]))
    _active_logs.append(log)
    try:
        yield log
    finally:
        _active_logs.remove(log)
        if not _active_logs:
            for name, original in _originals.items():
                setattr(dist, name, original)
            _originals.clear()
