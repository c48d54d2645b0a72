"""When this process waits on communication: the windows the power timeline and the power floor read.

A synchronous training step alternates work and waiting: the GPU computes, then sits in a
collective until its peers arrive and the bytes have crossed the link, then computes again.
Power follows (the power-stabilization paper, 2025: "synchronous training alternates
compute-heavy and communication-heavy phases each iteration"), so to see the job's power swing,
or to fill the waits with work (``meshlm/training/power_floor.py``), one must know when they
happen. Every collective and point-to-point message of meshlm goes through
``plain_collectives.py``, so that is where they are seen: a ``Group`` that carries a
``CommunicationWaits`` (``Group.waits``, like ``Group.link``) has

* each synchronous call (all-reduce, all-gather, reduce-scatter, all-to-all, barrier, object
  collectives) counted as a wait from the moment it is issued until it returns;
* each asynchronous call's handle wrapped, so that its ``wait()`` -- where the host stops until
  the bytes have arrived -- is counted as a wait (the time the communication overlapped with
  computation is not a wait: the device was busy). The pipeline's sends and receives are
  asynchronous handles too, so the pipeline's bubble (a stage waiting for its neighbour's
  activations or gradients) is counted, under the group name "pp".

Waits may nest (an object collective inside a wait, another thread's collective), so what is
recorded is their *union*: a window opens when the first wait starts and closes when the last
one ends, and is named by the group of the first (the one the host is stuck in). ``pending``
is a ``threading.Event`` set exactly while a window is open -- what the power floor's filler
thread waits on -- and ``drain()`` hands the closed windows, as (group name, start, end) in
``time.perf_counter`` seconds, to whoever records them. A window costs two clock reads and a
lock (measured: 2.3 us per wait on a loaded 2-core CPU host; 6 us with ``signal``, the events the
power floor's thread sleeps on), so recording them is affordable even under tensor parallelism's
thousands of collectives per step.

On CUDA with NCCL, a synchronous collective returns when it is enqueued, not when it is done:
the windows then hold the host's blocking waits (a ``wait()`` that synchronizes, object
collectives, barriers), not the kernels' own time on the device.
"""

from __future__ import annotations

import dataclasses
import threading
import time


class CommunicationWaits:
    """The open and closed wait windows of one process (see the module docstring)."""

    def __init__(self, signal: bool = True):
        self.signal = signal
        """Keep ``pending`` and ``settled`` up to date (for a thread that waits on them: the power
        floor's filler); without it a window costs only its clock reads and the lock."""
        self.pending = threading.Event()
        """Set while the host waits on some communication."""
        self.settled = threading.Event()
        """Set while it does not (``pending``'s complement: something to sleep on until a window closes)."""
        self.settled.set()
        self.windows_opened = 0
        """How many windows have opened so far: the current one's number while one is open."""
        self._lock = threading.Lock()
        self._depth = 0
        self._opened_at = 0.0
        self._opened_by = ""
        self._closed: list[tuple[str, float, float]] = []

    @property
    def waiting_on(self) -> str:
        """The group name of the open window ('' when none is open)."""
        return self._opened_by if self._depth > 0 else ""

    def begin(self, group_name: str) -> None:
        with self._lock:
            self._depth += 1
            if self._depth == 1:
                self._opened_at, self._opened_by = time.perf_counter(), group_name
                self.windows_opened += 1
                if self.signal:
                    self.settled.clear()
                    self.pending.set()

    def end(self) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                closed = time.perf_counter()
                if self.signal:
                    self.pending.clear()
                    self.settled.set()
                self._closed.append((self._opened_by, self._opened_at, closed))

    def open_since(self, window: int) -> float | None:
        """``time.perf_counter()`` now if window number ``window`` is still open, else None: read under
        the lock, so a time it returns lies inside the window."""
        with self._lock:
            return time.perf_counter() if self._depth > 0 and self.windows_opened == window else None

    def waiting(self, group_name: str) -> "Waiting":
        """``with waits.waiting(name):`` counts the body as a wait on group ``name``."""
        return Waiting(self, group_name)

    def drain(self) -> list[tuple[str, float, float]]:
        """The windows closed since the last call, oldest first: (group name, start, end)."""
        with self._lock:
            closed, self._closed = self._closed, []
        return closed


class Waiting:
    """The context manager of ``CommunicationWaits.waiting`` (a class: cheaper than a generator)."""

    __slots__ = ("waits", "group_name")

    def __init__(self, waits: CommunicationWaits, group_name: str):
        self.waits, self.group_name = waits, group_name

    def __enter__(self):
        self.waits.begin(self.group_name)

    def __exit__(self, *exc):
        self.waits.end()
        return False


class WatchedWork:
    """An asynchronous collective's handle whose ``wait()`` counts as a wait on its group."""

    def __init__(self, work, waits: CommunicationWaits, group_name: str):
        self.work, self.waits, self.group_name = work, waits, group_name

    def wait(self, *args, **kwargs):
        if self.work is None:
            return True
        with self.waits.waiting(self.group_name):
            return self.work.wait(*args, **kwargs)

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()

    def __getattr__(self, name):  # anything else a torch Work offers (result(), get_future(), ...)
        return getattr(self.work, name)


def watched(work, waits: CommunicationWaits | None, group_name: str):
    """``work`` wrapped so its ``wait()`` is counted (unchanged without ``waits`` or a handle)."""
    if waits is None or work is None:
        return work
    return WatchedWork(work, waits, group_name)


def watch_groups(context, waits: CommunicationWaits):
    """A copy of a ``ParallelContext`` whose every group carries ``waits`` (``Group.waits``); done
    once, right after the context is built and before anything keeps a group."""
    from meshlm.parallel.groups import Group

    changes = {field.name: dataclasses.replace(value, waits=waits) for field in dataclasses.fields(context)
               if isinstance(value := getattr(context, field.name), Group)}
    return dataclasses.replace(context, **changes)


__all__ = ["CommunicationWaits", "Waiting", "WatchedWork", "watch_groups", "watched"]
