"""Training that survives faults: a dead or hung rank, a restart, a non-finite step.

**A rank dies or hangs.** Every collective waits for all ranks of its group, so one rank that
never arrives would leave the others waiting forever. The process group is joined with a
timeout (``parallel.timeout_s``, handed to ``init_process_group``): a collective that does not
complete in that time raises on every rank still waiting. With gloo a peer that *died* is
noticed at once (its sockets close and the next read fails, measured at about 30 ms); a peer
that *hangs* is noticed after the timeout. ``explain_collective_failures`` turns the backend's
error into one sentence naming this rank, the collective, its group (``tp``, ``dp``, ``dp_cp``,
... as the mesh names them, with their global ranks) and the meshlm line that called it; the
``meshlm train`` command then prints it and exits with status ``EXIT_PEER_FAILURE`` at once,
without the process-group teardown, which could itself wait on the dead peer. Never a silent hang.

**Restart.** ``torchrun --max-restarts N`` notices a worker that exited or was killed, stops the
others and starts the whole group again (up to N times). Each attempt joins the process group in
a key space of its own in torchrun's store (``meshlm.parallel.mesh.join_process_group``: a
restarted rank must not read a dead rank's address), then resumes from the newest *complete*
checkpoint of ``train.run_dir`` (a save becomes visible only once every file of it is written,
so a save interrupted by the crash is ignored). A same-layout resume is exact: a crash costs the
steps since the last save, never the run, and the final weights equal those of a run that never
stopped (``tests/training/test_chaos.py`` kills ranks at random, inside saves too).

**A non-finite step.** A step whose loss or gradient holds an inf or nan is skipped: no update,
the step and its batch still count (the next step reads the next batch), ``skipped_steps`` grows
and the progress line says so. The decision must be the same on every rank, and it is taken from
the global gradient norm, which is all-reduced over the world for clipping anyway: a rank whose
loss is non-finite turns its gradient into nan (``MixedPrecision.scale_loss``), so the norm of
every rank is nan and no extra collective is needed. Skips in a row usually mean the weights or
the optimizer state are broken (or the learning rate is too high), not one bad batch; after
``train.max_consecutive_skips`` of them the run acts as ``train.on_nonfinite`` says:

* ``rollback`` -- reload the weights, optimizer moments, loss scaler and RNG state of the newest
  complete checkpoint in this process and go on. The step counter, the LR schedule and the data
  position are *not* rewound: the next step reads the next unseen batch, so the batches since
  that checkpoint (the offending ones among them) are not replayed -- replaying them would
  likely repeat the blow-up -- and the run still ends at ``train.steps`` having read each
  sample at most once (the remedy of Chowdhery et al. 2022, PaLM, §5.1: restart from a
  checkpoint before the spike and skip the batches around it). Periodic saves wait while a
  streak of skips lasts, so the checkpoint rolled back to was written after a clean step. After
  ``train.max_rollbacks`` rollbacks in one process the run stops instead.
* ``stop`` -- raise ``NonFiniteTrainingStop`` naming the step and the checkpoint to resume from.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import torch.distributed as dist

from meshlm.parallel.collective_log import CollectiveError
from meshlm.parallel.groups import Group

EXIT_PEER_FAILURE = 3
"""Exit status of ``meshlm train`` when a collective failed (a peer died or hung)."""
TRANSPORT_ERROR_MARKERS = ("gloo", "nccl", "timed out", "connection reset", "connection closed", "broken pipe")
"""Words of the backends' errors for a peer that went away; other RuntimeErrors are not ours."""
MESHLM_ROOT = str(Path(__file__).resolve().parents[1])
C10D_FILE = "distributed_c10d.py"
COLLECTIVES_FILES = ("plain_collectives.py", "collectives.py", "communication_waits.py")
"""meshlm's collectives (and the wrapper that times their waits, ``Group.waits``): the line that
called them is the one to report."""


class CollectiveFailure(RuntimeError):
    """A collective failed or timed out, most likely because a peer process died or hung."""


class NonFiniteTrainingStop(RuntimeError):
    """Too many steps in a row had a non-finite loss or gradient; the run stopped (train.on_nonfinite)."""


# --- a dead or hung peer ----------------------------------------------------------------------------------
def is_collective_failure(error: BaseException) -> bool:
    """True for the errors a collective raises when a peer is gone or too slow (not for bugs,
    nor for the collectives' own checks, whose messages mention NCCL)."""
    if isinstance(error, CollectiveError):
        return False
    if isinstance(error, dist.DistError):  # DistBackendError, DistNetworkError, DistStoreError
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(marker in text for marker in TRANSPORT_ERROR_MARKERS)


def group_description(group) -> str:
    """``group dp (ranks [0, 2])`` as the mesh named it, or ``the world (ranks 0-3)``."""
    if not dist.is_initialized():
        return "an unknown group"
    if isinstance(group, Group):
        return f"group {group.describe()}"
    if group is None or group is dist.group.WORLD:
        return f"the world (ranks 0-{dist.get_world_size() - 1})"
    name = getattr(group, "group_desc", "") or "unnamed"
    name = name.removeprefix("mesh_") if name.startswith("mesh_") else name
    try:
        ranks = dist.get_process_group_ranks(group)
    except (RuntimeError, ValueError):
        return f"group {name}"
    return f"group {name} (ranks {ranks})"


def _frames(error: BaseException) -> list[tuple[FrameType, int]]:
    return list(traceback.walk_tb(error.__traceback__))


def _caller(frames: list[tuple[FrameType, int]]) -> tuple[FrameType, int] | None:
    """The innermost meshlm frame (outside this file and the collectives): the line of ours that was waiting."""
    ours = [(frame, line) for frame, line in frames if frame.f_code.co_filename.startswith(MESHLM_ROOT)
            and not frame.f_code.co_filename.endswith(("fault_tolerance.py",) + COLLECTIVES_FILES)]
    return ours[-1] if ours else None


def _waited_group(frame: FrameType):
    """The one process group a frame that waited on an asynchronous collective refers to, if any."""
    kinds = (dist.ProcessGroup, Group)
    candidates = [value for value in frame.f_locals.values() if isinstance(value, kinds)]
    owner = frame.f_locals.get("self")
    candidates += [value for value in vars(owner).values() if isinstance(value, kinds)] \
        if hasattr(owner, "__dict__") else []
    unique = {id(group): group for group in candidates}
    return next(iter(unique.values())) if len(unique) == 1 else None


def backend_message(error: BaseException) -> str:
    """The backend's own words, without its source path and boilerplate advice."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(error).strip())
    return text.split(" This is typically caused")[0].strip().rstrip(".")


def describe_collective_failure(error: BaseException, timeout_s: float | None = None) -> str:
    """One message: which rank, which collective over which group, called from where, and what to do."""
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    frames = _frames(error)
    collective = next(((frame, line) for frame, line in frames if frame.f_code.co_filename.endswith(C10D_FILE)),
                      None)  # the outermost: what our code called
    caller = _caller(frames)
    if collective is not None:
        frame = collective[0]
        named = next((ours.f_locals.get("group") for ours, _ in frames
                      if ours.f_code.co_filename.endswith(COLLECTIVES_FILES[0])), None)  # our Group, by name
        group = named if isinstance(named, Group) else frame.f_locals.get("group")
        what = f"collective {frame.f_code.co_name} over {group_description(group)}"
    elif caller is not None and (group := _waited_group(caller[0])) is not None:
        what = f"an asynchronous collective over {group_description(group)}"
    else:
        what = "a collective"
    where = ""
    if caller is not None:
        frame, line = caller
        where = f" (called from {os.path.relpath(frame.f_code.co_filename, Path(MESHLM_ROOT).parent)}:{line} " \
                f"in {frame.f_code.co_name})"
    verdict = "timed out" if "timed out" in str(error).lower() else "failed"
    limit = f" after parallel.timeout_s={timeout_s:g} s" if timeout_s is not None and verdict == "timed out" else ""
    return (f"rank {rank}: {what} {verdict}{limit}{where}: {backend_message(error)}. A peer process probably "
            "died or hung; its own log says why. Under torchrun --max-restarts N the job restarts by itself "
            "from the newest complete checkpoint in train.run_dir.")


@contextlib.contextmanager
def explain_collective_failures(timeout_s: float | None = None):
    """Re-raise a collective's failure (a dead or hung peer) as ``CollectiveFailure`` with a clear message."""
    try:
        yield
    except Exception as error:
        if isinstance(error, CollectiveFailure) or not is_collective_failure(error):
            raise
        raise CollectiveFailure(describe_collective_failure(error, timeout_s)) from error


def exit_after_collective_failure(failure: CollectiveFailure) -> None:
    """Print the failure and leave at once with ``EXIT_PEER_FAILURE``. ``os._exit`` skips the
    process-group teardown and interpreter shutdown, which may block on the peer that is gone."""
    print(f"meshlm train: error: {failure}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_PEER_FAILURE)


# --- non-finite steps -----------------------------------------------------------------------------------
@dataclass
class SkipStreak:
    """Counts skipped steps in a row and says when there have been too many."""

    limit: int
    """train.max_consecutive_skips (0: never act)."""
    action: str
    """train.on_nonfinite: 'rollback' or 'stop'."""
    max_rollbacks: int
    """train.max_rollbacks: rollbacks allowed in this process before stopping instead."""
    length: int = 0
    """Skipped steps in a row so far."""
    rollbacks: int = 0
    """Rollbacks done in this process."""

    @classmethod
    def from_config(cls, train) -> "SkipStreak":
        return cls(train.max_consecutive_skips, train.on_nonfinite, train.max_rollbacks)

    def record(self, skipped: bool) -> str | None:
        """Count one step; None to go on, else 'rollback' or 'stop'."""
        self.length = self.length + 1 if skipped else 0
        if self.limit == 0 or self.length < self.limit:
            return None
        return "rollback" if self.action == "rollback" and self.rollbacks < self.max_rollbacks else "stop"

    def rolled_back(self) -> None:
        self.length = 0
        self.rollbacks += 1


def stop_message(step: int, streak: SkipStreak, checkpoint: Path | None) -> str:
    """Why the run stops, and what the user can do."""
    why = (f"step {step}: {streak.length} steps in a row had a non-finite loss or gradient "
           f"(train.max_consecutive_skips={streak.limit})")
    if streak.action == "rollback" and checkpoint is None:
        why += " and there is no complete checkpoint to roll back to"
    elif streak.action == "rollback":
        why += f" after {streak.rollbacks} rollbacks (train.max_rollbacks={streak.max_rollbacks})"
    resume = f"the newest complete checkpoint is {checkpoint}" if checkpoint is not None else "no checkpoint exists"
    return (f"{why}; stopping ({resume}). Lower optim.lr, tighten train.grad_clip, or check the data around "
            "this step; train.on_nonfinite=rollback continues from the checkpoint past these batches.")


__all__ = ["EXIT_PEER_FAILURE", "CollectiveFailure", "NonFiniteTrainingStop", "SkipStreak",
           "backend_message", "describe_collective_failure", "exit_after_collective_failure",
           "explain_collective_failures", "group_description", "is_collective_failure", "stop_message"]
