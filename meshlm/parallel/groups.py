"""A process group as meshlm's collectives see it: a name, its ranks, the run's device, the run's record.

torch.distributed names a group by a ``ProcessGroup`` handle, which knows its ranks but not what
it is for nor what it may carry. Every collective of meshlm (``meshlm/parallel/collectives.py``)
takes a ``Group`` instead, which adds what its checks need:

* ``name`` -- the layout's word for the group: "tp", "dp", "pp", "cp", "dp_cp", "ep", "etp",
  "edp", "world", "embedding" (a pipeline's first and last stage), "checkpoint" (the
  checkpoint's own gloo group). Error messages and the cross-rank comparison speak of it.
* ``device`` -- where every tensor a collective over the group moves must live: the run's
  device. NCCL moves CUDA tensors only; a CPU tensor handed to it fails far from the line that
  made it, or not at all on a CPU test machine, where every tensor is on the CPU anyway. So the
  collectives refuse a tensor on another device, always (a comparison of two devices per call).
  The checkpoint's gloo group carries objects through the CPU, so its device is the CPU.
* ``log`` -- the run's ``CollectiveLog`` when ``parallel.check_collectives`` is on (every call
  over the group is recorded and compared across ranks after each step:
  ``meshlm/parallel/collective_checks.py``), else None.

The groups of a run are built once, by ``mesh.build_parallel_context``, and live on the
``ParallelContext``; a collective learns everything from its ``group`` argument, so nothing is
looked up in a module-level "current run". A group of one rank is None, as before.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass(frozen=True, eq=False)
class Group:
    """A process group with its name, members, device and record (see the module docstring).
    Compared and hashed by identity, like the ``ProcessGroup`` it wraps."""

    name: str
    process_group: dist.ProcessGroup = field(repr=False)
    ranks: tuple[int, ...]
    """Global ranks of the members, in group-rank order."""
    rank: int
    """This process's rank in the group."""
    device: torch.device
    """The device of every tensor a collective over this group moves (the run's device)."""
    log: object | None = field(default=None, repr=False)
    """The run's ``CollectiveLog`` (``parallel.check_collectives``), else None."""
    link: object | None = field(default=None, repr=False)
    """A ``SimulatedLink`` (``parallel.simulate_link``, a testing aid) every collective over this
    group waits out, else None (``meshlm/parallel/simulated_link.py``)."""
    waits: object | None = field(default=None, repr=False)
    """The run's ``CommunicationWaits``: every wait on a collective over this group is recorded as
    a window (the power timeline, the power floor), else None (``communication_waits.py``)."""

    @property
    def size(self) -> int:
        return len(self.ranks)

    def describe(self) -> str:
        """``tp (ranks [0, 1])``: how messages name the group."""
        return f"{self.name} (ranks {list(self.ranks)})"

    def unrecorded(self) -> "Group":
        """The same group without the record: for the comparison's own collective."""
        return dataclasses.replace(self, log=None)


def group_of(process_group: dist.ProcessGroup, name: str, device: torch.device, log=None) -> Group:
    """Wrap a ``ProcessGroup`` this process belongs to (``dist.group.WORLD`` for the world)."""
    ranks = tuple(dist.get_process_group_ranks(process_group))
    return Group(name, process_group, ranks, ranks.index(dist.get_rank()), torch.device(device), log)


def on_device(device: torch.device, tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lives on ``device`` (an index-less device, "cuda", accepts any index)."""
    if tensor.device.type != device.type:
        return False
    return device.index is None or tensor.device.index == device.index


__all__ = ["Group", "group_of", "on_device"]
