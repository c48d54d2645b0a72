"""Non-finite steps (meshlm/training/fault_tolerance.py): skipped on every rank, counted, logged;
K in a row roll back to the newest complete checkpoint (equal to resuming it at the current step
and data position) or stop with a clear message. Faults are injected deterministically by a
Trainer subclass: an inf added to the loss (its gradients stay finite, so only the loss check
catches it) or a nan written into a weight (every later step is non-finite until a rollback).
Single process and 2 spawned gloo ranks (dp2 + distributed optimizer, tp2) with the fault on
rank 1 only. Dead and hung peers, and torchrun restarts: tests/training/test_chaos.py.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from meshlm.checkpoint.folders import checkpoint_dirs
from meshlm.cli import main
from meshlm.errors import ConfigError
from meshlm.parallel.tensor.sharding import gather_full_state_dict
from meshlm.training.fault_tolerance import NonFiniteTrainingStop, SkipStreak, backend_message
from meshlm.training.metrics import read_metrics
from meshlm.training.trainer import Trainer
from tests.helpers.distributed import import_test_file, run_distributed
from tests.helpers.tiny_training import relative_error

TOLERANCE = 1e-5
ROLLBACK_RUN = ["train.steps=10", "train.save_every=2", "train.keep_checkpoints=5", "train.eval_every=0",
                "train.max_consecutive_skips=3"]
"""A nan weight at step 5 makes steps 5-7 fail; the third failure rolls back to step_4."""


HELPERS = import_test_file(Path(__file__).parent / "test_parallel_training.py", "parallel_training_helpers")
"""tests/training/test_parallel_training.py's run helpers (test files cannot import each other)."""


class FaultyTrainer(Trainer):
    """A Trainer that injects faults on chosen steps (numbered as logged: the first step is 1), on
    the ranks in ``ranks`` (all when None), and keeps the full parameters after every step."""

    def __init__(self, config, inf_loss_steps=(), nan_weight_steps=(), ranks=None):
        super().__init__(config)
        self.inf_loss_steps, self.nan_weight_steps = set(inf_loss_steps), set(nan_weight_steps)
        self.faulty = ranks is None or self.context.rank in ranks
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}
        forward = self.model.forward

        def forward_with_fault(*args, **kwargs):
            output = forward(*args, **kwargs)
            if self.faulty and self.state.step + 1 in self.inf_loss_steps:
                output.loss = output.loss + float("inf")  # the gradient of a constant is zero: grads stay finite
            return output

        self.model.forward = forward_with_fault

    def train_step(self):
        if self.faulty and self.state.step + 1 in self.nan_weight_steps:
            norm = next(param for name, param in self.model.named_parameters() if name.endswith("norm.weight"))
            with torch.no_grad():  # a norm weight: every token goes through it
                norm.view(-1)[0] = float("nan")
        return super().train_step()

    def after_step(self, step_result, result):
        super().after_step(step_result, result)
        self.snapshots[self.state.step] = {name: value.clone() for name, value in
                                           gather_full_state_dict(self.model, self.context).items()}


def same_parameters(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def checkpoint_steps(run_dir) -> list[int]:
    return [step for step, _ in checkpoint_dirs(run_dir)]


# --- one process -------------------------------------------------------------------------------------------
def test_a_non_finite_loss_skips_the_step_even_with_finite_gradients(make_config):
    config = make_config("train.steps=5", "train.eval_every=0")
    trainer = FaultyTrainer(config, inf_loss_steps={3})
    result = trainer.run()
    assert result.skipped_steps == 1 and result.rollbacks == 0
    assert math.isinf(result.losses[3]) and all(math.isfinite(result.losses[step]) for step in (1, 2, 4, 5))
    assert same_parameters(trainer.snapshots[3], trainer.snapshots[2])  # no update at step 3
    assert not same_parameters(trainer.snapshots[4], trainer.snapshots[3])  # and training goes on
    records = {record["step"]: record for record in read_metrics(Path(config.train.run_dir) / "metrics.jsonl")
               if "loss" in record}
    assert [records[step]["skipped_steps"] for step in range(1, 6)] == [0, 0, 1, 1, 1]


@pytest.fixture(scope="module")
def rollback_run(tmp_path_factory, corpus_blend) -> dict:
    """A single-process run whose weights turn nan at step 5; rolled back at step 7 to step_4."""
    root = tmp_path_factory.mktemp("rollback")
    trainer = FaultyTrainer(HELPERS.run_config(corpus_blend, root / "run", *ROLLBACK_RUN), nan_weight_steps={5})
    result = trainer.run()
    return dict(root=root, run_dir=root / "run", result=result, final=trainer.snapshots[10])


def test_k_skips_in_a_row_roll_back_to_the_last_checkpoint(rollback_run, corpus_blend):
    result, run_dir = rollback_run["result"], rollback_run["run_dir"]
    assert result.rollbacks == 1 and result.skipped_steps == 3 and result.step == 10
    assert [step for step in sorted(result.losses) if not math.isfinite(result.losses[step])] == [5, 6, 7]
    assert checkpoint_steps(run_dir) == [2, 4, 8, 10]  # step 6's save waited for a clean step
    events = [record for record in read_metrics(run_dir / "metrics.jsonl") if record.get("event") == "rollback"]
    assert len(events) == 1 and events[0]["step"] == 7 and events[0]["checkpoint"].endswith("step_4")
    # the rollback equals resuming step_4 at step 7's position: the same weights, optimizer,
    # loss scale and RNG, and the next unseen batch (samples 7*G onwards; none replayed)
    reference_dir = rollback_run["root"] / "reference"
    shutil.copytree(run_dir / "checkpoints" / "step_4", reference_dir / "checkpoints" / "step_4")
    config = HELPERS.run_config(corpus_blend, reference_dir, *ROLLBACK_RUN)
    reference = FaultyTrainer(config)
    reference.state.step, reference.state.consumed_samples = 7, 7 * config.train.global_batch_size
    resumed = reference.run()
    assert sorted(resumed.losses) == [8, 9, 10]
    assert all(resumed.losses[step] == result.losses[step] for step in (8, 9, 10))  # bitwise
    assert same_parameters(reference.snapshots[10], rollback_run["final"])


def test_k_skips_in_a_row_stop_when_asked(make_config):
    config = make_config(*ROLLBACK_RUN, "train.on_nonfinite=stop")
    with pytest.raises(NonFiniteTrainingStop, match=r"step 7: 3 steps in a row had a non-finite loss or gradient "
                                                    r"\(train.max_consecutive_skips=3\).*step_4"):
        FaultyTrainer(config, nan_weight_steps={5}).run()
    assert checkpoint_steps(config.train.run_dir) == [2, 4]  # nothing failing was saved


def test_rollback_without_a_checkpoint_or_past_max_rollbacks_stops(make_config):
    config = make_config(*ROLLBACK_RUN, "train.save_every=0")
    with pytest.raises(NonFiniteTrainingStop, match="no complete checkpoint to roll back to"):
        FaultyTrainer(config, nan_weight_steps={5}).run()
    # a second streak after the allowed rollback: steps 5-7 roll back, steps 9-11 stop
    config = make_config(*ROLLBACK_RUN, "train.steps=12", "train.max_rollbacks=1")
    with pytest.raises(NonFiniteTrainingStop, match=r"step 11: .*after 1 rollbacks \(train.max_rollbacks=1\)"):
        FaultyTrainer(config, nan_weight_steps={5, 9}).run()


def test_skip_streak_and_config_checks(make_config):
    streak = SkipStreak(limit=2, action="rollback", max_rollbacks=1)
    assert [streak.record(skipped) for skipped in (True, False, True)] == [None, None, None]
    assert streak.record(True) == "rollback"
    streak.rolled_back()
    assert [streak.record(True), streak.record(True)] == [None, "stop"]
    assert SkipStreak(limit=0, action="stop", max_rollbacks=0).record(True) is None
    with pytest.raises(ConfigError, match="train.on_nonfinite='retry' is not one of rollback, stop"):
        make_config("train.on_nonfinite=retry")
    with pytest.raises(ConfigError, match="train.max_consecutive_skips=-1"):
        make_config("train.max_consecutive_skips=-1")
    gloo = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:693: Connection "
            "reset by peer. This is typically caused by a remote worker hanging or bugs in the application.")
    assert backend_message(RuntimeError(gloo)) == "Read error [127.0.0.1]:693: Connection reset by peer"


def test_the_command_exits_non_zero_with_the_reason(make_config, monkeypatch, capsys):
    import meshlm.training.trainer as trainer_module

    def stopped(config, **options):
        raise NonFiniteTrainingStop("step 7: 3 steps in a row had a non-finite loss")

    monkeypatch.setattr(trainer_module, "train", stopped)
    assert main(["train", "train.steps=1"]) == 1
    assert "meshlm train: stopped: step 7: 3 steps in a row" in capsys.readouterr().err


# --- two ranks: the fault on rank 1 only ---------------------------------------------------------------
LAYOUTS = {"dp2 dist-opt async-save": ["parallel.dp=2", "parallel.distributed_optimizer=true", "train.async_save=true"],
           "tp2": ["parallel.tp=2"]}


def faulty_runs(blend: str, root: str) -> dict:
    """In each spawned rank: per layout, an inf loss at step 3 and a rollback run, faults on rank 1."""
    torch.set_num_threads(1)
    results = {}
    for name, layout in LAYOUTS.items():
        config = HELPERS.run_config(Path(blend), Path(root) / f"{name} skip", "train.steps=4", "train.eval_every=0",
                                    *layout)
        skipper = FaultyTrainer(config, inf_loss_steps={3}, ranks={1})
        skipped = skipper.run()
        config = HELPERS.run_config(Path(blend), Path(root) / f"{name} rollback", *ROLLBACK_RUN, *layout)
        rolled = FaultyTrainer(config, nan_weight_steps={5}, ranks={1})
        rollback = rolled.run()
        results[name] = dict(skipped=skipped.skipped_steps, unchanged=same_parameters(skipper.snapshots[3],
                                                                                      skipper.snapshots[2]),
                             rollbacks=rollback.rollbacks, losses=rollback.losses, final=rolled.snapshots[10])
    return results


def test_two_ranks_skip_and_roll_back_together(rollback_run, corpus_blend, tmp_path):
    by_rank = run_distributed(faulty_runs, 2, str(corpus_blend), str(tmp_path), timeout_s=240)
    single = rollback_run["result"]
    for rank, results in enumerate(by_rank):
        for name, run in results.items():
            where = f"{name} rank {rank}"
            assert run["skipped"] == 1 and run["unchanged"], where  # rank 0 skipped rank 1's bad step too
            assert run["rollbacks"] == 1, where
            finite = [step for step in sorted(single.losses) if math.isfinite(single.losses[step])]
            assert [step for step in sorted(run["losses"]) if math.isfinite(run["losses"][step])] == finite, where
            assert relative_error([run["losses"][s] for s in finite], [single.losses[s] for s in finite]) \
                <= TOLERANCE, where
            for param, value in rollback_run["final"].items():
                assert relative_error(run["final"][param], value) <= TOLERANCE, (where, param)
