"""Run a function in N real gloo processes on CPU: the harness of the multi-process tests.

Distributed code is tested with real ``torch.distributed`` (never mocked): ``run_distributed(fn,
world_size, *args)`` runs ``fn(*args, **kwargs)`` in ``world_size`` spawned Python processes
joined into a fresh gloo process group (rendezvous through a file in a new temporary folder) and
returns the list of their return values, indexed by rank. ``fn`` must be a top-level function of
an importable module or of a test file; inside it ``dist.get_rank()`` is the rank, and ``RANK``,
``WORLD_SIZE`` and ``LOCAL_RANK`` are set as torchrun sets them, so ``build_parallel_context``
works unchanged. The process group is destroyed when fn returns.

The harness is a test helper, not part of the library: tests and ``bench/`` scripts import it as
``tests.helpers.distributed`` (pytest's ``pythonpath`` puts the repository root on sys.path, and
a bench script runs from the root). Test files themselves are loaded with
``--import-mode=importlib`` and cannot import each other by name; ``import_test_file`` lets one
reuse another's helpers.

Reused processes. Starting a Python process that imports torch costs about 2 s of CPU; a world
of 4 on a 2-core machine took 7-12 s to start, per call. So the spawned processes are kept
(``daemon``) after a successful call and serve the next one: worker i always plays rank i, each
call gets a new process group, and a call needing more ranks spawns the missing workers. A
call that fails or times out kills the workers it used, and the next call starts fresh ones.
``fresh_processes=True`` (or ``MESHLM_TEST_FRESH_PROCESSES=1``) spawns new ones for one call.

On a GPU (tests/gpu): ``cuda_device=0`` makes every rank's current CUDA device GPU 0 before it
joins, so that several ranks share the one GPU (torch would otherwise pick GPU ``LOCAL_RANK``),
and ``backend="nccl"`` joins with NCCL instead of gloo (NCCL refuses two ranks on one GPU, so
the GPU tier's multi-rank tests keep gloo, which moves CUDA tensors through the host).

Failures must be loud and quick, never a hung CI job:

* a rank that raises sends its traceback; the parent gives the others a moment, kills those still
  running (they would wait forever in a collective the failed rank never enters) and raises
  ``DistributedRunError`` with every failed rank's traceback;
* a call still going after ``timeout_s`` is killed and raises ``DistributedTimeout`` naming the
  ranks that had not finished (the process group gets the same timeout, so a stuck collective
  also fails on its own);
* a rank that dies without a Python exception (killed, crashed) is reported by its exit code.

How fn travels: spawned processes do not share the parent's ``sys.modules``, and a test file
loaded by importlib mode is not importable by name. So the worker loads fn's file under the
module name the parent gave it, *then* unpickles the arguments (which may refer to that module),
runs fn and sends the result back serialized by ``torch.save``.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import importlib
import importlib.util
import io
import os
import pickle
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

import torch
import torch.distributed as dist
import torch.multiprocessing


class DistributedRunError(AssertionError):
    """A rank of a ``run_distributed`` call failed; the message holds its traceback."""


class DistributedTimeout(DistributedRunError):
    """A ``run_distributed`` call did not finish in time; its processes were killed."""


GRACE_AFTER_FAILURE_S = 3.0
"""After one rank fails, how long the others may still finish on their own before being killed."""


# --- in the worker -------------------------------------------------------------------------------

def _load_function(module_name: str, file: str, qualname: str):
    """Import fn's module: normally when it is importable from the same file, otherwise (a test
    file) from its path under the parent's module name."""
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


def _run_task(rank: int, world_size: int, folder: str, reference, payload: bytes, timeout_s: float,
              backend: str = "gloo", cuda_device: int | None = None) -> bytes:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    if cuda_device is not None:
        torch.cuda.set_device(cuda_device)
    dist.init_process_group(backend, init_method=f"file://{folder}/rendezvous", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    # gloo's init returns on a rank once its own connections are up; a task that calls no collective
    # (a layout refused at start-up) could then tear its group down while a slower rank is still
    # connecting, which fails that rank ("connectFullMesh failed ... Connection closed by peer").
    # One barrier holds every rank until all are connected.
    if backend == "gloo":
        dist.barrier()
    function = _load_function(*reference)
    args, kwargs = pickle.loads(payload)
    result = function(*args, **kwargs)
    buffer = io.BytesIO()
    torch.save(result, buffer)
    del function, args, kwargs, result
    dist.destroy_process_group()
    # The task's process groups live on in reference cycles (a model and its groups, a mesh and its
    # children) until the collector finds them, each with gloo's threads, which keep polling their
    # closed sockets: hundreds accumulate in a worker over a test session and take the CPU the
    # tests need. Collecting here ends them with their task.
    gc.collect()
    torch.set_grad_enabled(True)
    torch.set_default_dtype(torch.float32)
    return buffer.getvalue()


def _worker(connection: Connection) -> None:
    """Serve tasks until the pipe closes. After a failure the worker exits at once, without the
    group's teardown: the other ranks may be stuck waiting for this one."""
    torch.set_num_threads(1)
    while True:
        try:
            task = connection.recv()
        except EOFError:
            return
        try:
            connection.send(("ok", _run_task(*task)))
        except BaseException:
            connection.send(("error", traceback.format_exc()))
            sys.stderr.flush()
            os._exit(1)


# --- in the parent -------------------------------------------------------------------------------

@dataclass
class _Worker:
    process: object
    connection: Connection


_workers: list[_Worker] = []
"""Worker i plays rank i; kept between calls."""


def _spawn_worker() -> _Worker:
    context = torch.multiprocessing.get_context("spawn")
    parent_end, child_end = context.Pipe()
    process = context.Process(target=_worker, args=(child_end,), daemon=True, name="meshlm-test-rank")
    process.start()
    child_end.close()  # so that the parent sees EOF when the worker dies
    return _Worker(process, parent_end)


def _kill(workers: list[_Worker]) -> None:
    for worker in workers:
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join()
        worker.connection.close()


def _shut_down_pool() -> None:
    _kill(_workers)
    _workers.clear()


atexit.register(_shut_down_pool)


def _function_reference(fn) -> tuple[str, str, str]:
    if "<locals>" in fn.__qualname__ or "<lambda>" in fn.__qualname__:
        raise ValueError(f"run_distributed needs a top-level function (spawned processes import it by "
                         f"name), got {fn.__qualname__}; move it to module level.")
    module = sys.modules[fn.__module__]
    return fn.__module__, os.path.abspath(module.__file__), fn.__qualname__


def _collect(workers: list[_Worker], timeout_s: float) -> tuple[list, dict[int, str], list[int]]:
    """Wait for every rank's message: (results by rank, failure messages by rank, ranks still
    running at the deadline or after the grace period that follows a failure)."""
    waiting = {worker.connection: rank for rank, worker in enumerate(workers)}
    results, failures = [None] * len(workers), {}
    deadline, failed_at = time.monotonic() + timeout_s, None
    while waiting:
        limit = deadline if failed_at is None else min(deadline, failed_at + GRACE_AFTER_FAILURE_S)
        if time.monotonic() >= limit:
            break
        for connection in wait(list(waiting), timeout=limit - time.monotonic()):
            rank = waiting.pop(connection)
            try:
                status, content = connection.recv()
            except EOFError:
                workers[rank].process.join(timeout=5)
                status, content = "died", workers[rank].process.exitcode
            if status == "ok":
                results[rank] = content
                continue
            failures[rank] = (f"rank {rank} raised:\n{content}" if status == "error" else
                              f"rank {rank} died with exit code {content} (a signal or crash, no Python exception).")
            failed_at = failed_at or time.monotonic()
    return results, failures, sorted(waiting.values())


def import_test_file(path, module_name: str):
    """Load a test file as module ``module_name`` and register it in ``sys.modules``, so another
    test file can reuse its helpers (pytest's importlib mode does not let test files import each
    other) and ``run_distributed`` can send its functions to the spawned ranks by module name.
    A module already loaded under that name is returned as it is."""
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, os.fspath(path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def run_distributed(fn, world_size: int, *args, timeout_s: float = 120.0, fresh_processes: bool = False,
                    backend: str = "gloo", cuda_device: int | None = None, **kwargs) -> list:
    """Call ``fn(*args, **kwargs)`` in ``world_size`` gloo processes; return the results by rank.
    Raises ``DistributedRunError`` (with the failing ranks' tracebacks) or ``DistributedTimeout``
    (after killing every process still running). ``backend`` and ``cuda_device``: see the module
    docstring (the GPU tier's options; the defaults are plain gloo on CPU)."""
    reference = _function_reference(fn)
    payload = pickle.dumps((args, kwargs))
    if fresh_processes or os.environ.get("MESHLM_TEST_FRESH_PROCESSES") == "1":
        _shut_down_pool()
    while len(_workers) < world_size:
        _workers.append(_spawn_worker())
    workers = _workers[:world_size]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="meshlm_dist_") as folder:
        for rank, worker in enumerate(workers):
            worker.connection.send((rank, world_size, folder, reference, payload, timeout_s, backend, cuda_device))
        results, failures, still_running = _collect(workers, timeout_s)
        if failures or still_running:
            _kill(workers)
            del _workers[:world_size]
    if failures:
        killed = f"\n(ranks {still_running} were still running and were killed.)" if still_running else ""
        raise DistributedRunError(f"{len(failures)} of {world_size} ranks failed.\n"
                                  + "\n".join(failures[rank] for rank in sorted(failures)) + killed)
    if still_running:
        raise DistributedTimeout(f"ranks {still_running} of {world_size} were still running after "
                                 f"{time.monotonic() - started:.0f} s (timeout_s={timeout_s}) and were "
                                 "killed; a collective that not every rank entered?")
    return [torch.load(io.BytesIO(result), weights_only=False) for result in results]
