"""Run a function in N real gloo processes on CPU: the harness of the multi-process tests.

Distributed code is tested with real ``torch.distributed`` (never mocked): ``run_distributed(fn,
world_size, *args)`` spawns ``world_size`` fresh Python processes, joins them into a gloo process
group through a file in a temporary folder, calls ``fn(*args, **kwargs)`` in each and returns the
list of their return values, indexed by rank. ``fn`` must be a top-level function of an importable
module or of a test file; inside it ``dist.get_rank()`` is the rank, and ``RANK``, ``WORLD_SIZE``
and ``LOCAL_RANK`` are set as torchrun sets them, so ``build_parallel_context`` works unchanged.

The harness lives in the package (not a conftest) because pytest imports test files with
``--import-mode=importlib``, where test files cannot import each other; any test can import this.

Failures must be loud and quick, never a hung CI job:

* a rank that raises writes its traceback to a file; the parent gives the others a moment, kills
  those still running (they would wait forever in a collective the failed rank never enters) and
  raises ``DistributedRunError`` with every failed rank's traceback;
* a run still going after ``timeout_s`` is killed and raises ``DistributedTimeout`` naming the
  ranks that had not finished (the process group gets the same timeout, so a stuck collective
  also fails on its own);
* a rank that dies without a Python exception (killed, crashed) is reported by its exit code.

How fn travels: spawned children do not share the parent's ``sys.modules``, and a test file
loaded by importlib mode is not importable by name. So the child loads fn's file under the
module name the parent gave it, *then* unpickles the arguments (which may refer to that module),
runs fn and saves the result with ``torch.save``; the parent loads it. Each child uses one
intra-op thread (the tests are tiny and the machine small).
"""

from __future__ import annotations

import datetime
import importlib
import importlib.util
import os
import pickle
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
import torch.multiprocessing


class DistributedRunError(AssertionError):
    """A rank of a ``run_distributed`` call failed; the message holds its traceback."""


class DistributedTimeout(DistributedRunError):
    """A ``run_distributed`` call did not finish in time; its processes were killed."""


GRACE_AFTER_FAILURE_S = 3.0
"""After one rank fails, how long the others may still finish on their own before being killed."""


def _function_reference(fn) -> tuple[str, str, str]:
    if "<locals>" in fn.__qualname__ or "<lambda>" in fn.__qualname__:
        raise ValueError(f"run_distributed needs a top-level function (spawned processes import it by "
                         f"name), got {fn.__qualname__}; move it to module level.")
    module = sys.modules[fn.__module__]
    return fn.__module__, os.path.abspath(module.__file__), fn.__qualname__


def _load_function(module_name: str, file: str, qualname: str):
    """Import fn's module in the child: normally when it is importable from the same file,
    otherwise (a test file) from its path under the parent's module name."""
    module = sys.modules.get(module_name)
    if module is None:
        try:
            spec = importlib.util.find_spec(module_name)
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.origin and os.path.abspath(spec.origin) == file:
            module = importlib.import_module(module_name)
        else:
            spec = importlib.util.spec_from_file_location(module_name, file)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
    function = module
    for part in qualname.split("."):
        function = getattr(function, part)
    return function


def _child(rank: int, world_size: int, folder: str, reference, payload: bytes, timeout_s: float) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
        function = _load_function(*reference)
        args, kwargs = pickle.loads(payload)
        result = function(*args, **kwargs)
        partial = os.path.join(folder, f"result_{rank}.partial")
        torch.save(result, partial)
        os.replace(partial, os.path.join(folder, f"result_{rank}.pt"))
    except BaseException:
        with open(os.path.join(folder, f"error_{rank}.txt"), "w") as file:
            file.write(traceback.format_exc())
        sys.stderr.flush()
        os._exit(1)  # skip the group's teardown: the other ranks may be stuck waiting for this one
    dist.destroy_process_group()


def _wait(processes, deadline: float) -> bool:
    """Wait until every process has exited (True), a process failed and the grace period has
    passed, or the deadline (False if processes are still alive)."""
    failed_at = None
    while True:
        alive = [process for process in processes if process.exitcode is None]
        if not alive:
            return True
        if failed_at is None and any(process.exitcode not in (None, 0) for process in processes):
            failed_at = time.monotonic()
        limit = deadline if failed_at is None else min(deadline, failed_at + GRACE_AFTER_FAILURE_S)
        if time.monotonic() >= limit:
            return False
        wait([process.sentinel for process in alive], timeout=min(0.5, max(0.0, limit - time.monotonic())))


def _failure_report(processes, folder: str, world_size: int, timed_out: list[int]) -> str:
    lines = []
    for rank, process in enumerate(processes):
        error_file = os.path.join(folder, f"error_{rank}.txt")
        if os.path.exists(error_file):
            with open(error_file) as file:
                lines.append(f"rank {rank} of {world_size} raised:\n{file.read()}")
        elif rank not in timed_out and process.exitcode not in (0, None):
            lines.append(f"rank {rank} of {world_size} died with exit code {process.exitcode} "
                         "(a signal or crash, no Python exception).")
    return "\n".join(lines)


def run_distributed(fn, world_size: int, *args, timeout_s: float = 120.0, **kwargs) -> list:
    """Call ``fn(*args, **kwargs)`` in ``world_size`` spawned gloo processes; return the results
    by rank. Raises ``DistributedRunError`` (with the failing ranks' tracebacks) or
    ``DistributedTimeout`` (after killing every process still running)."""
    reference = _function_reference(fn)
    payload = pickle.dumps((args, kwargs))
    spawn = torch.multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="meshlm_dist_") as folder:
        processes = [spawn.Process(target=_child, args=(rank, world_size, folder, reference, payload, timeout_s),
                                   daemon=True, name=f"meshlm-rank-{rank}") for rank in range(world_size)]
        for process in processes:
            process.start()
        started = time.monotonic()
        finished = _wait(processes, started + timeout_s)
        still_running = [rank for rank, process in enumerate(processes) if process.exitcode is None]
        for process in processes:
            if process.exitcode is None:
                process.kill()
            process.join()
        report = _failure_report(processes, folder, world_size, still_running)
        if report:
            killed = f"\n(ranks {still_running} were still running and were killed.)" if still_running else ""
            raise DistributedRunError(report + killed)
        if not finished:
            raise DistributedTimeout(f"ranks {still_running} of {world_size} were still running after "
                                     f"{time.monotonic() - started:.0f} s (timeout_s={timeout_s}) and were "
                                     "killed; a collective that not every rank entered?")
        return [torch.load(os.path.join(folder, f"result_{rank}.pt"), weights_only=False)
                for rank in range(world_size)]
