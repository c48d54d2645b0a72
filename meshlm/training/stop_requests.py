"""Stopping a run cleanly before it is killed: SIGTERM, SIGINT and ``train.time_limit_minutes``.

A cluster ends a job with a signal and a grace period: Slurm sends SIGTERM when a job is
cancelled, preempted or reaches its time limit, and SIGKILL ``KillWait`` seconds later (30 by
default); Kubernetes sends SIGTERM to the container's first process and SIGKILL after
``terminationGracePeriodSeconds`` (30 by default); a user at a terminal presses Ctrl-C (SIGINT).
Python's defaults are bad for training: SIGTERM ends the process at once, losing every step since
the last save, and SIGINT raises ``KeyboardInterrupt`` wherever the program happens to be.
Here a signal is only *recorded*; the run stops at the end of the current step, saves a
checkpoint, writes ``{"event": "stopped", ...}`` to metrics.jsonl, prints one line saying where
to resume, and ``meshlm train`` exits with status 0. Running the same command again resumes.

**Why at the end of a step.** Only between two steps does everything a checkpoint holds
describe one moment: weights, fp32 masters, Adam moments, loss scaler, step counter and data
position. Inside a step, gradients are half accumulated, a data-parallel reduction or a pipeline
schedule is in flight. A checkpoint taken between steps resumes exactly -- the stopped and
resumed run's loss curve equals the uninterrupted one bit for bit -- and it costs at most one
step of waiting, far less than the grace period for any sensible step time. Nothing slow
(no evaluation) runs after the request: only the save. A stop during a streak of skipped
(non-finite) steps saves too: a skipped step leaves the weights and the optimizer untouched.

**Why every rank must agree.** The save is collective (every rank writes its shards, then rank
0 commits; ``meshlm/checkpoint/distributed.py``), so all ranks must stop after the *same* step.
But a signal reaches ranks at different moments: torchrun forwards it to one worker after the
other, Slurm signals every task of a step on its own, an operator may signal one process, and a
rank's own clock decides the time limit. So each rank's request is only a vote. At the end of
every step the ranks all-reduce (MAX) one small integer over the world -- 0 to go on, otherwise
the reason's code (``REASONS``) -- and all of them stop after the first step in which any rank
voted, with the same reason. That is one all-reduce of one number per step, and none at all
in a world of one process.

**The time limit** (``train.time_limit_minutes``, 0 = none), measured from the start of the
``Trainer`` (so start-up before it -- launching, importing -- is not counted: set the limit a
little below the scheduler's). A step that ends at ``elapsed`` seconds is the last one when

    elapsed + longest_step > limit

where ``longest_step`` is the longest time between the ends of two steps so far in this process,
periodic evaluations and saves included. Going on would mean one more step, which may take that
long, and then a save; stopping now leaves that margin for the save alone. Once a periodic save
has happened the margin holds a step and a save; before, it assumes a save is no slower than a
step (true when the compute per step outweighs writing the weights and optimizer state).

**Handlers.** They are installed only by the main thread (Python runs handlers there and
refuses to install them from others; a run in another thread still has its time limit), only
while ``Trainer.run`` runs, and the previous ones come back afterwards: the trainer also runs
inside other programs (the tests, ``meshlm demo``). A second SIGINT while stopping raises
``KeyboardInterrupt`` as Python's default would, so a user can still force-quit (a save cut
short is never seen as complete; the previous checkpoint stays the newest). A repeated SIGTERM
is ignored: under Slurm a torchrun worker gets one from Slurm and one forwarded by torchrun.

**Under torchrun** the launcher catches SIGTERM and SIGINT, sends the same signal to every
worker's process group, waits ``--shutdown-timeout`` seconds (default 30, or the environment's
``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``) for them to exit, and only then SIGKILLs the rest: the
current step and the save must fit in that time. Workers run in sessions of their own, so a
Ctrl-C at the terminal reaches them once, through torchrun. The workers exit 0, but torchrun
itself re-raises the signal as an exception and exits with status 1 (its own behaviour); a
worker signalled directly (by Slurm, or by hand) stops the whole job with status 0.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from meshlm.parallel.collectives import all_reduce_, group_size

REASONS = (None, "time limit", "SIGINT", "SIGTERM")
"""Why a run stops, by the code each rank votes in the all-reduce (its index; MAX wins)."""
SIGNALS = (signal.SIGTERM, signal.SIGINT)


def time_is_up(elapsed_s: float, longest_step_s: float, limit_s: float) -> bool:
    """True when a step ending at ``elapsed_s`` must be the last: one more step of the longest kind
    so far, then a save, might not end before ``limit_s`` (0 = no limit)."""
    return limit_s > 0 and elapsed_s + longest_step_s > limit_s


class StopRequests:
    """This process's reasons to stop (a signal, the time limit), and the decision all ranks share.

    Create it when the trainer starts (the time limit's clock starts then); ``listen()`` when the
    steps begin, ``close()`` when the run ends; ``agreed_reason()`` at the end of every step, on
    every rank. ``clock`` (seconds, monotonic) is there for tests.
    """

    def __init__(self, time_limit_minutes: float = 0.0, clock: Callable[[], float] = time.monotonic):
        self.time_limit_minutes = time_limit_minutes
        self.clock = clock
        self.started = clock()
        self.last_step_end = self.started
        self.longest_step_s = 0.0
        self.signal_name: str | None = None
        """The first signal received ('SIGTERM' or 'SIGINT'), if any."""
        self.previous_handlers: dict[int, object] = {}

    # --- signals ---------------------------------------------------------------------------------------
    def listen(self) -> None:
        """Record SIGTERM and SIGINT from now on (main thread only); step times count from now."""
        self.last_step_end = self.clock()
        if threading.current_thread() is not threading.main_thread():
            return
        for number in SIGNALS:
            self.previous_handlers[number] = signal.signal(number, self.on_signal)

    def close(self) -> None:
        """Put back the handlers that were there before ``listen()``."""
        for number, handler in self.previous_handlers.items():
            signal.signal(number, handler if handler is not None else signal.SIG_DFL)
        self.previous_handlers = {}

    def on_signal(self, number: int, frame) -> None:
        if number == signal.SIGINT and self.signal_name is not None:
            raise KeyboardInterrupt  # a second Ctrl-C while stopping: force-quit
        if self.signal_name is None:
            self.signal_name = signal.Signals(number).name

    # --- the decision at the end of a step --------------------------------------------------------------
    def local_reason(self) -> str | None:
        """This rank's reason to stop after the step that just ended (None: go on)."""
        now = self.clock()
        self.longest_step_s = max(self.longest_step_s, now - self.last_step_end)
        self.last_step_end = now
        if self.signal_name is not None:
            return self.signal_name
        if time_is_up(now - self.started, self.longest_step_s, self.time_limit_minutes * 60):
            return "time limit"
        return None

    def agreed_reason(self, world_group) -> str | None:
        """The reason to stop after this step that every rank returns alike (None: go on).
        Collective over ``world_group`` (the context's; None in one process): call it on every
        rank after every step."""
        reason = self.local_reason()
        if group_size(world_group) == 1:
            return reason
        vote = torch.tensor([REASONS.index(reason)], device=world_group.device)
        all_reduce_(vote, world_group, op="max")
        return REASONS[int(vote.item())]

    def message(self, reason: str, step: int, steps: int, checkpoint: Path) -> str:
        """The one line a stopped run prints."""
        cause = f"train.time_limit_minutes={self.time_limit_minutes:g}" if reason == "time limit" else reason
        return (f"meshlm train: stopped by {cause} at step {step}/{steps}; saved {checkpoint} -- run the same "
                "command to resume.")


__all__ = ["REASONS", "StopRequests", "time_is_up"]
