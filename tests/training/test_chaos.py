"""Dead ranks, hung ranks and restarts, with real processes (meshlm/training/fault_tolerance.py).

* A rank killed (SIGKILL) mid-training: the surviving ranks exit with status 3 within the
  collective timeout (gloo notices the closed sockets at once) and say which collective over
  which group failed. A rank that hangs (SIGSTOP): the survivor exits after the timeout.
* Chaos: ``torchrun --max-restarts`` runs a small job while ranks are killed at moments drawn
  from a seeded RNG -- mid-training, during start-up, and inside saves (written but not yet
  committed). Every restart resumes from the newest complete checkpoint, and the final weights and
  the whole logged loss curve equal, bit for bit, those of a run that was never interrupted.

The ranks run ``tests/training/chaos_worker.py`` (``meshlm train`` plus pid files and optional
delays). Every process started here is killed by pid when a test ends, however it ends.
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

import meshlm
from meshlm.checkpoint.folders import checkpoint_dirs, latest_checkpoint
from meshlm.checkpoint.model_files import load_model
from meshlm.training.fault_tolerance import EXIT_PEER_FAILURE
from meshlm.training.metrics import read_metrics

WORKER = Path(__file__).with_name("chaos_worker.py")
PACKAGE_ROOT = Path(meshlm.__file__).resolve().parents[1]
CHAOS_SEED = 2024


def run_overrides(blend: Path, run_dir: Path, *extra: str) -> list[str]:
    """The tiny dp2 run of these tests (two ranks, distributed optimizer), as command-line overrides."""
    return ["model.vocab_size=64", "model.hidden_size=32", "model.num_attention_heads=4", "model.pattern=*-",
            "train.seq_len=16", "train.micro_batch_size=2", "train.global_batch_size=4", "train.log_every=1",
            "train.eval_every=0", "train.progress=false", "train.tensorboard=false", "train.plot=false",
            "train.device=cpu", f"train.run_dir={run_dir}", f"data.blend={blend}", "data.split=90,10,0",
            "optim.lr=3e-3", "optim.warmup_steps=2", "parallel.distributed_optimizer=true", *extra]


def worker_environment(chaos_dir: Path, **delays: float) -> dict[str, str]:
    env = dict(os.environ, MESHLM_CHAOS_DIR=str(chaos_dir), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")])))
    env.update({f"MESHLM_CHAOS_{name.upper()}_DELAY_S": str(value) for name, value in delays.items()})
    return env


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def worker_pids(chaos_dir: Path) -> dict[tuple[int, int], int]:
    """{(restart, rank): pid} from the workers' pid files."""
    found = {}
    for path in (chaos_dir / "pids").glob("*.pid"):
        restart, rank = map(int, path.stem.split("-"))
        found[restart, rank] = int(path.read_text())
    return found


def kill_leftovers(chaos_dir: Path, *processes: subprocess.Popen) -> None:
    """SIGKILL every process this test started that is still there (by pid, checked to be ours)."""
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)  # started in its own session: it leads its group
            process.wait()
    for pid in worker_pids(chaos_dir).values():
        try:
            if str(WORKER) in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                os.kill(pid, signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError):
            pass


def metrics_records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return read_metrics(path) if path.is_file() else []


def start_records(records: list[dict]) -> list[int]:
    """Positions of the start and resume records (one per attempt that got that far)."""
    return [index for index, record in enumerate(records) if record.get("event") in ("start", "resume")]


def logged_steps(run_dir: Path) -> list[dict]:
    """The step records of metrics.jsonl written since the last start or resume."""
    records = metrics_records(run_dir)
    starts = start_records(records)
    return [record for record in records[starts[-1] + 1 if starts else 0:] if "loss" in record]


def wait_for(condition, timeout_s: float, what: str, processes=()):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if any(process.poll() is not None for process in processes):
            raise AssertionError(f"a process exited while waiting for {what}")
        time.sleep(0.01)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


# --- a dead or hung rank ----------------------------------------------------------------------------
def start_ranks(world: int, overrides: list[str], chaos_dir: Path, **delays: float) -> list[subprocess.Popen]:
    """``world`` ranks of one job, started the way torchrun would but with nobody watching them."""
    env = worker_environment(chaos_dir, **delays) | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                                                     "WORLD_SIZE": str(world)}
    chaos_dir.mkdir(parents=True, exist_ok=True)
    return [subprocess.Popen([sys.executable, str(WORKER), *overrides], env=env | {"RANK": str(rank),
                                                                                  "LOCAL_RANK": str(rank)},
                             stdout=(chaos_dir / f"rank{rank}.out").open("w"), stderr=subprocess.STDOUT,
                             start_new_session=True) for rank in range(world)]


def survivors_after(signal_number: int, world: int, victim: int, timeout_s: float, tmp_path: Path,
                    corpus_blend: Path) -> tuple[dict[int, float], dict[int, str], list[subprocess.Popen]]:
    """Send ``signal_number`` to one rank at step 3; (seconds until each survivor exited, its output)."""
    chaos_dir, run_dir = tmp_path / "ranks", tmp_path / "run"
    overrides = run_overrides(corpus_blend, run_dir, "train.steps=400", "train.save_every=0",
                              f"parallel.timeout_s={timeout_s}", "train.global_batch_size=12")
    processes = start_ranks(world, overrides, chaos_dir, step=0.05)
    try:
        wait_for(lambda: len(logged_steps(run_dir)) >= 3, 120, "step 3", processes)
        processes[victim].send_signal(signal_number)
        signalled = time.monotonic()
        exited = {}
        while len(exited) < world - 1 and time.monotonic() < signalled + timeout_s + 60:
            for rank, process in enumerate(processes):
                if rank != victim and rank not in exited and process.poll() is not None:
                    exited[rank] = time.monotonic() - signalled
            time.sleep(0.01)
        outputs = {rank: (chaos_dir / f"rank{rank}.out").read_text() for rank in range(world)}
        return exited, outputs, processes
    finally:
        kill_leftovers(chaos_dir, *processes)


def assert_explained(output: str, rank: int, verdict: str) -> None:
    line = next((line for line in output.splitlines() if "meshlm train: error: rank" in line), None)
    assert line is not None, output[-3000:]
    assert re.search(rf"rank {rank}: (collective \w+|an asynchronous collective) over (group \w+ \(ranks|the world)"
                     rf".* {verdict}", line), line
    assert "A peer process probably died or hung" in line and "torchrun --max-restarts" in line, line


def test_a_killed_rank_makes_the_survivors_exit_within_the_timeout(tmp_path, corpus_blend):
    timeout_s = 30.0
    exited, outputs, processes = survivors_after(signal.SIGKILL, 3, 1, timeout_s, tmp_path, corpus_blend)
    print(f"\nSIGKILL of rank 1 of 3: survivors exited after {exited} s (timeout {timeout_s} s)")
    assert sorted(exited) == [0, 2], (exited, outputs)
    for rank in (0, 2):
        assert exited[rank] < timeout_s, exited  # a dead peer is noticed without waiting for the timeout
        assert processes[rank].returncode == EXIT_PEER_FAILURE, outputs[rank][-3000:]
        assert_explained(outputs[rank], rank, "failed")


def test_a_hung_rank_makes_the_survivor_exit_after_the_timeout(tmp_path, corpus_blend):
    timeout_s = 12.0
    exited, outputs, processes = survivors_after(signal.SIGSTOP, 2, 1, timeout_s, tmp_path, corpus_blend)
    print(f"\nSIGSTOP of rank 1 of 2: the survivor exited after {exited} s (timeout {timeout_s} s)")
    assert sorted(exited) == [0], (exited, outputs)
    assert timeout_s - 1 <= exited[0] <= timeout_s + 15, exited
    assert processes[0].returncode == EXIT_PEER_FAILURE, outputs[0][-3000:]
    assert_explained(outputs[0], 0, "timed out after parallel.timeout_s=12 s")


# --- chaos under torchrun ------------------------------------------------------------------------------------
WORLD = 2
CHAOS_RUN = ["train.steps=24", "train.save_every=3", "train.keep_checkpoints=2", "parallel.timeout_s=60"]
PLAN = ("step", "save", "startup", "save")
"""The kinds of kill, in order; the moment and the rank of each are drawn from Random(CHAOS_SEED)."""


def start_torchrun(overrides: list[str], chaos_dir: Path, max_restarts: int, **delays: float) -> subprocess.Popen:
    chaos_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}",
               f"--max-restarts={max_restarts}", "--monitor-interval=0.1", str(WORKER), *overrides]
    return subprocess.Popen(command, env=worker_environment(chaos_dir, **delays), stdout=(chaos_dir / "torchrun.out")
                            .open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def saves_in_progress(run_dir: Path) -> set[str]:
    """Entries of the checkpoints folder that are not complete checkpoints: saves under way (or
    left behind by a save that was killed)."""
    root = run_dir / "checkpoints"
    complete = {path.name for _, path in checkpoint_dirs(run_dir)}
    return {path.name for path in root.iterdir()} - complete if root.is_dir() else set()


def next_attempt_started(chaos_dir: Path, attempt: int):
    pids = worker_pids(chaos_dir)
    return all((attempt, rank) in pids for rank in range(WORLD))


def kill_at(kind: str, rng: random.Random, attempt: int, run_dir: Path, chaos_dir: Path,
            torchrun: subprocess.Popen) -> str:
    """Wait for the moment of one kill of ``kind`` in attempt ``attempt``, then SIGKILL a random rank."""
    wait_for(lambda: next_attempt_started(chaos_dir, attempt), 120, f"attempt {attempt}", [torchrun])
    if kind == "startup":  # while importing, joining the process group or building model and data
        time.sleep(rng.uniform(0.0, 2.0))
    elif kind == "step":  # k steps after this attempt's start (or resume) record
        steps, starts = rng.randint(1, 4), len(start_records(metrics_records(run_dir)))
        wait_for(lambda: len(start_records(metrics_records(run_dir))) > starts and len(logged_steps(run_dir)) >= steps,
                 120, f"{steps} steps", [torchrun])
        time.sleep(rng.uniform(0.0, 0.1))
    else:  # inside a save: its files are written but not yet committed
        stale = saves_in_progress(run_dir)
        started = wait_for(lambda: saves_in_progress(run_dir) - stale, 120, "a save", [torchrun])
        kind = f"inside the save {', '.join(sorted(started))}"
    rank = rng.randrange(WORLD)
    os.kill(worker_pids(chaos_dir)[attempt, rank], signal.SIGKILL)
    return f"attempt {attempt}: killed rank {rank} ({kind})"


def final_state(run_dir: Path) -> tuple[dict[str, torch.Tensor], dict[int, float]]:
    """The newest checkpoint's weights (single-process names and shapes) and the logged loss curve."""
    weights = load_model(latest_checkpoint(run_dir)).state_dict()
    losses = {record["step"]: record["loss"] for record in read_metrics(run_dir / "metrics.jsonl")
              if "loss" in record and "event" not in record}
    return weights, losses


def test_chaos_kills_under_torchrun_restarts_resume_exactly(tmp_path, corpus_blend):
    reference_dir, chaos_run_dir = tmp_path / "reference", tmp_path / "chaos"
    processes, log = [], []
    try:
        reference = start_torchrun(run_overrides(corpus_blend, reference_dir, *CHAOS_RUN), tmp_path / "ref-pids", 0)
        processes.append(reference)
        assert reference.wait(timeout=180) == 0, (tmp_path / "ref-pids" / "torchrun.out").read_text()[-3000:]

        chaos_dir, rng = tmp_path / "chaos-pids", random.Random(CHAOS_SEED)
        started = time.monotonic()
        torchrun = start_torchrun(run_overrides(corpus_blend, chaos_run_dir, *CHAOS_RUN), chaos_dir, len(PLAN),
                                  step=0.02, save=0.15)
        processes.append(torchrun)
        for attempt, kind in enumerate(PLAN):
            log.append(kill_at(kind, rng, attempt, chaos_run_dir, chaos_dir, torchrun))
        code = torchrun.wait(timeout=180)
        output = (chaos_dir / "torchrun.out").read_text()
        print(f"\nchaos: {'; '.join(log)}; finished in {time.monotonic() - started:.1f} s")
        assert code == 0, output[-4000:]
    finally:
        kill_leftovers(tmp_path / "ref-pids", *processes[:1])
        kill_leftovers(tmp_path / "chaos-pids", *processes[1:])

    attempts = sorted({attempt for attempt, _ in worker_pids(chaos_dir)})
    assert attempts == list(range(len(PLAN) + 1)), attempts  # one restart per kill, no other failure
    resumed = [int(step) for step in re.findall(r"resuming from \S*step_(\d+) at step \d+", output)]
    assert resumed == sorted(resumed) and resumed, output[-4000:]  # later attempts never go back
    print(f"chaos: attempts resumed from steps {resumed}")
    weights, losses = final_state(chaos_run_dir)
    expected_weights, expected_losses = final_state(reference_dir)
    assert losses == expected_losses and sorted(losses) == list(range(1, 25))  # the whole curve, bitwise
    assert weights.keys() == expected_weights.keys()
    for name, value in expected_weights.items():
        assert torch.equal(weights[name], value), name
