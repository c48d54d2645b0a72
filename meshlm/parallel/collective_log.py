"""What one rank records of its communication under ``parallel.check_collectives``, and the errors
of the collectives' checks.

NCCL needs two things of a program that torch.distributed does not check (and gloo, which the
CPU tests run, forgives): every member of a group issues the same collectives over it, with
the same shapes and dtypes, in the same order; and no two ranks issue collectives over two
groups they share in opposite orders -- one rank waiting in group A for a peer that waits in
group B for it is a deadlock. Point-to-point messages are matched per pair of ranks by issue
order, the same way.

With ``parallel.check_collectives`` every ``Group`` of the run holds the run's ``CollectiveLog``,
and every collective and point-to-point call of ``meshlm/parallel/collectives.py`` appends a
``Call`` to it when it is *issued* (an asynchronous one counts when it starts, not when it is
waited for). After every step the ranks compare their records
(``meshlm/parallel/collective_checks.py``).
"""

from __future__ import annotations

from typing import NamedTuple


class CollectiveError(RuntimeError):
    """A collective that NCCL could not run safely (a program error, reported in one sentence)."""


class WrongDevice(CollectiveError):
    """A tensor handed to a collective does not live on the run's device."""


class CollectiveMismatch(CollectiveError):
    """The ranks' recorded collectives disagree (``parallel.check_collectives``)."""


class Call(NamedTuple):
    """One recorded collective or point-to-point operation."""

    group: str
    """The group's name ("tp", "dp_cp", ...; "pp p2p" for a message between two pipeline ranks)."""
    ranks: tuple[int, ...]
    """The group's global ranks (a message: its two ends, lower first)."""
    op: str
    """"all_reduce", "all_reduce(max)", "all_gather", "reduce_scatter", "all_to_all", "barrier",
    "all_gather_object", ..., or "send" / "recv"."""
    shapes: tuple
    """Shapes of the tensors it moves; ``None`` for a size that may differ between ranks (the
    rows of an uneven all-to-all)."""
    dtypes: tuple[str, ...]
    peer: int | None = None
    """send / recv: the global rank at the other end."""
    tag: int | None = None
    """send / recv: the message's tag."""

    def describe(self) -> str:
        shapes = ", ".join("(" + ", ".join("*" if size is None else str(size) for size in shape) + ")"
                           for shape in self.shapes)
        what = f"{self.op} [{shapes}] {'/'.join(self.dtypes)}".rstrip()
        if self.peer is not None:
            what += f" {'to' if self.op == 'send' else 'from'} rank {self.peer} (tag {self.tag})"
        return what

    def key(self) -> tuple[str, tuple[int, ...]]:
        """What identifies its group on every member: name and ranks."""
        return self.group, self.ranks


class CollectiveLog:
    """This rank's calls since the last comparison, in issue order."""

    def __init__(self):
        self.calls: list[Call] = []

    def record(self, call: Call) -> None:
        self.calls.append(call)

    def take(self) -> list[Call]:
        """The calls recorded so far; the log starts empty again."""
        calls, self.calls = self.calls, []
        return calls


__all__ = ["Call", "CollectiveError", "CollectiveLog", "CollectiveMismatch", "WrongDevice"]
