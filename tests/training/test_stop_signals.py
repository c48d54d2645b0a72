"""SIGTERM, SIGINT and train.time_limit_minutes (meshlm/training/stop_requests.py), with real processes.

* A signal to a running ``python -m meshlm train``: it saves the step it is in, writes a
  ``stopped`` event, prints one line naming the checkpoint and exits 0; the same command then
  resumes to the end, and the whole loss curve equals an uninterrupted run's bit for bit.
* The same under ``torchrun`` with two data-parallel ranks, signalling the launcher (which
  forwards SIGTERM to every worker) or one worker only: the ranks agree on the step to stop
  after, so both write their shards of one complete checkpoint.
* The time limit: its rule with a test clock, and a real run that stops early and saves.

Every process started here is killed by pid when a test ends, however it ends.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import meshlm
from meshlm.checkpoint.folders import latest_checkpoint
from meshlm.training.metrics import read_metrics
from meshlm.training.stop_requests import SIGNALS, StopRequests, time_is_up
from meshlm.training.trainer import train

PACKAGE_ROOT = Path(meshlm.__file__).resolve().parents[1]
STEPS = 60
"""Long enough that a signal sent after the third step lands well before the end (5-30 ms a step)."""


def run_overrides(blend: Path, run_dir: Path) -> list[str]:
    """A tiny CPU run that saves asynchronously every 4 steps (so a stop may find a save in flight)."""
    return ["model.vocab_size=64", "model.hidden_size=32", "model.num_attention_heads=4", "model.pattern=*-",
            "train.seq_len=16", "train.micro_batch_size=2", "train.global_batch_size=4", f"train.steps={STEPS}",
            "train.log_every=1", "train.eval_every=0", "train.save_every=4", "train.async_save=true",
            "train.progress=false", "train.tensorboard=false", "train.plot=false", "train.device=cpu",
            f"train.run_dir={run_dir}", f"data.blend={blend}", "data.split=90,10,0", "optim.lr=3e-3",
            "optim.warmup_steps=2"]


def start_training(blend: Path, run_dir: Path, world: int) -> tuple[subprocess.Popen, Path]:
    """``python -m meshlm train ...`` (world 1) or ``torchrun --nproc_per_node 2 -m meshlm train ...``;
    the process and the file its output goes to."""
    train_command = ["-m", "meshlm", "train", *run_overrides(blend, run_dir)]
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
                "--monitor-interval=0.1"] if world > 1 else []
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")])))
    log = run_dir.with_name(f"{run_dir.name}-{len(list(run_dir.parent.glob(f'{run_dir.name}-*.out')))}.out")
    process = subprocess.Popen([sys.executable, *launcher, *train_command], env=env, stdout=log.open("w"),
                               stderr=subprocess.STDOUT, start_new_session=True)
    return process, log


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (torchrun's workers are its children)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            pass
    return found


def worker_pid(launcher: int, rank: int) -> int:
    """The pid of the torchrun worker with ``RANK=rank`` (read from its environment)."""
    for pid in children(launcher):
        try:
            if f"RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return pid
        except OSError:
            pass
    raise AssertionError(f"no worker of rank {rank} under torchrun (pid {launcher})")


def finish(process: subprocess.Popen, log: Path, timeout_s: float = 120) -> tuple[int, str]:
    """Wait for the process (and its workers) and return its exit status and output; on a timeout
    or any error, SIGKILL whatever of it is left."""
    workers = children(process.pid)
    try:
        return process.wait(timeout=timeout_s), log.read_text()
    finally:
        for pid in workers:  # a worker runs in a session of its own: not in the launcher's group
            try:
                if "meshlm" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                    os.kill(pid, signal.SIGKILL)
            except (FileNotFoundError, ProcessLookupError):
                pass
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)  # started in its own session: it leads its group
            process.wait()


def step_losses(run_dir: Path) -> dict[int, float]:
    return {record["step"]: record["loss"] for record in read_metrics(run_dir / "metrics.jsonl")
            if "loss" in record and "event" not in record}


def wait_for_steps(run_dir: Path, process: subprocess.Popen, count: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while len(step_losses(run_dir)) < count:
        assert process.poll() is None, f"the run exited before step {count}"
        assert time.monotonic() < deadline, f"timed out waiting for step {count}"
        time.sleep(0.01)


def stop_with(signal_number: int, target: str, blend: Path, run_dir: Path, world: int) -> tuple[int, str]:
    """Start a run, send ``signal_number`` to ``target`` ('process', 'launcher' or 'rank 1') after
    three logged steps, and return the exit status and output of the whole run."""
    process, log = start_training(blend, run_dir, world)
    try:
        wait_for_steps(run_dir, process, 3)
        victim = worker_pid(process.pid, 1) if target == "rank 1" else process.pid
        os.kill(victim, signal_number)
    finally:
        code, output = finish(process, log)
    return code, output


def assert_stopped_and_saved(output: str, run_dir: Path, reason: str, world: int) -> int:
    """The stop line, the checkpoint it names (complete, the newest, every rank's shards) and the
    ``stopped`` event; returns the step it stopped after."""
    line = re.search(rf"meshlm train: stopped by {reason} at step (\d+)/{STEPS}; saved (\S+) -- run the same "
                     r"command to resume\.", output)
    assert line is not None, output[-3000:]
    assert output.count("meshlm train: stopped by") == 1 and "meshlm train: done" not in output
    step, checkpoint = int(line[1]), Path(line[2])
    assert 3 <= step < STEPS and checkpoint == run_dir / "checkpoints" / f"step_{step}"
    assert latest_checkpoint(run_dir) == checkpoint
    assert {path.name.split("_")[2] for path in checkpoint.glob("__*_*.distcp")} == {str(rank) for rank in range(world)}
    stopped = read_metrics(run_dir / "metrics.jsonl")[-1]
    assert isinstance(stopped.pop("time"), float)  # when (meshlm status reads it)
    assert stopped == {"event": "stopped", "step": step, "reason": reason, "checkpoint": str(checkpoint)}
    assert max(step_losses(run_dir)) == step
    return step


@pytest.fixture(scope="module")
def uninterrupted_losses(tmp_path_factory, corpus_blend):
    """``losses(world)``: the loss curve of the run never interrupted (one run per world size)."""
    curves = {}

    def losses(world: int) -> dict[int, float]:
        if world not in curves:
            run_dir = tmp_path_factory.mktemp(f"uninterrupted-{world}") / "run"
            code, output = finish(*start_training(corpus_blend, run_dir, world))
            assert code == 0, output[-3000:]
            curves[world] = step_losses(run_dir)
            assert sorted(curves[world]) == list(range(1, STEPS + 1))
        return curves[world]

    return losses


def resume_to_the_end(blend: Path, run_dir: Path, world: int, stopped_step: int) -> dict[int, float]:
    code, output = finish(*start_training(blend, run_dir, world))
    assert code == 0, output[-3000:]
    assert f"resuming from {run_dir / 'checkpoints' / f'step_{stopped_step}'} at step {stopped_step}" in output
    return step_losses(run_dir)


# --- one process --------------------------------------------------------------------------------------
def test_sigterm_saves_the_step_exits_0_and_the_same_command_resumes_exactly(tmp_path, corpus_blend,
                                                                             uninterrupted_losses):
    run_dir = tmp_path / "run"
    code, output = stop_with(signal.SIGTERM, "process", corpus_blend, run_dir, world=1)
    assert code == 0 and "Traceback" not in output, output[-3000:]
    step = assert_stopped_and_saved(output, run_dir, "SIGTERM", world=1)
    print(f"\nSIGTERM: stopped after step {step} of {STEPS}")
    assert resume_to_the_end(corpus_blend, run_dir, 1, step) == uninterrupted_losses(1)  # every step, bitwise


def test_sigint_saves_the_step_and_exits_0(tmp_path, corpus_blend):
    """Ctrl-C: the same stop as SIGTERM (the resume is the same too), no KeyboardInterrupt traceback."""
    run_dir = tmp_path / "run"
    code, output = stop_with(signal.SIGINT, "process", corpus_blend, run_dir, world=1)
    assert code == 0 and "Traceback" not in output, output[-3000:]
    step = assert_stopped_and_saved(output, run_dir, "SIGINT", world=1)
    print(f"\nSIGINT: stopped after step {step} of {STEPS}")


# --- two ranks under torchrun ---------------------------------------------------------------------------
def test_sigterm_to_one_torchrun_worker_stops_every_rank_after_the_same_step(tmp_path, corpus_blend,
                                                                             uninterrupted_losses):
    """Only rank 1 is signalled: rank 0 learns of it from the end-of-step vote, both ranks write
    their shards of the same step's checkpoint, both exit 0 (so torchrun does), and the same
    command resumes to the uninterrupted two-rank loss curve."""
    run_dir = tmp_path / "run"
    code, output = stop_with(signal.SIGTERM, "rank 1", corpus_blend, run_dir, world=2)
    assert code == 0, output[-3000:]
    step = assert_stopped_and_saved(output, run_dir, "SIGTERM", world=2)
    print(f"\nSIGTERM to rank 1 of 2: both ranks stopped after step {step} of {STEPS}")
    assert resume_to_the_end(corpus_blend, run_dir, 2, step) == uninterrupted_losses(2)  # every step, bitwise


def test_sigterm_to_the_torchrun_launcher_reaches_every_worker_in_time(tmp_path, corpus_blend):
    """torchrun forwards SIGTERM to every worker and waits for them (--shutdown-timeout, 30 s by
    default) before it SIGKILLs any: the workers save and exit by themselves. torchrun then
    re-raises the signal and exits with status 1 (its own behaviour, not checked here)."""
    run_dir = tmp_path / "run"
    code, output = stop_with(signal.SIGTERM, "launcher", corpus_blend, run_dir, world=2)
    assert "Sending process" in output and "closing signal SIGTERM" in output, output[-3000:]  # forwarded
    assert "forcefully exiting" not in output and "meshlm train: error" not in output, output[-3000:]
    step = assert_stopped_and_saved(output, run_dir, "SIGTERM", world=2)
    print(f"\nSIGTERM to torchrun: forwarded, both ranks stopped after step {step} of {STEPS} (torchrun exit {code})")


# --- the handlers ----------------------------------------------------------------------------------------
def test_a_second_sigint_force_quits_and_the_previous_handlers_come_back():
    before = [signal.getsignal(number) for number in SIGNALS]
    requests = StopRequests()
    requests.listen()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # a repeated SIGTERM (Slurm and torchrun both send one): ignored
        assert requests.agreed_reason(None) == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while stopping: Python's default
            time.sleep(1)  # the handler runs in this thread before the sleep ends
    finally:
        requests.close()
    assert [signal.getsignal(number) for number in SIGNALS] == before


# --- the time limit ------------------------------------------------------------------------------------
def test_the_time_limit_leaves_room_for_the_longest_step():
    assert not time_is_up(elapsed_s=50, longest_step_s=9, limit_s=60)
    assert time_is_up(elapsed_s=50, longest_step_s=11, limit_s=60)
    assert not time_is_up(elapsed_s=1e9, longest_step_s=1e9, limit_s=0)  # 0: no limit
    now = [0.0]
    requests = StopRequests(time_limit_minutes=1, clock=lambda: now[0])  # the trainer starts at 0 s
    now[0] = 10.0  # start-up done, the steps begin
    requests.listen()
    requests.close()
    reasons = []
    for end in (15.0, 20.0, 40.0, 45.0):  # 5 s steps; the third one included a 15 s save
        now[0] = end
        reasons.append(requests.agreed_reason(None))
    # after 40 s: 40 + 20 (the longest step) = 60, not over; after 45 s: 45 + 20 > 60
    assert reasons == [None, None, None, "time limit"]


def test_a_run_past_its_time_limit_saves_stops_and_resumes(make_config, capsys):
    config = make_config("train.steps=50", "train.time_limit_minutes=1e-6", "train.plot=true")  # 60 us: one step
    run_dir = Path(config.train.run_dir)
    before = [signal.getsignal(number) for number in SIGNALS]
    result = train(config)
    assert (result.stopped_by, result.step, sorted(result.losses)) == ("time limit", 1, [1])
    assert [signal.getsignal(number) for number in SIGNALS] == before  # handlers restored after the run
    checkpoint = run_dir / "checkpoints" / "step_1"
    assert latest_checkpoint(run_dir) == checkpoint
    stopped = read_metrics(run_dir / "metrics.jsonl")[-1]
    assert isinstance(stopped.pop("time"), float)
    assert stopped == {"event": "stopped", "step": 1, "reason": "time limit", "checkpoint": str(checkpoint)}
    assert (f"meshlm train: stopped by train.time_limit_minutes=1e-06 at step 1/50; saved {checkpoint} -- run "
            "the same command to resume.") in capsys.readouterr().err
    assert (run_dir / "loss.png").is_file()  # the plot is still drawn
    again = train(config)  # the same command resumes; the clock starts again with the new trainer
    assert (again.stopped_by, again.step, sorted(again.losses)) == ("time limit", 2, [2])
