"""meshlm/rl/cli.py: a non-finite stop exits 1 with one line, on every rank alike; ``--pass-at``.

The non-finite loss is real: the KL term's reference model (``rl.reference_from``) has a nan in
one weight, so every step's reference log-probabilities, hence its loss and gradient, are nan
while the policy (which samples the rollouts) stays finite. Every step is skipped, and after
train.max_consecutive_skips of them train.on_nonfinite=stop ends the run.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

from meshlm.checkpoint.model_files import save_model
from meshlm.cli import main
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel
from meshlm.rl.loop import GRPOTrainer
from meshlm.training.metrics import read_metrics
from tests.helpers.allocation_failure import cpu_allocator_refusal
from tests.helpers.distributed import run_distributed
from tests.rl.conftest import MODEL, rl_overrides

STOP = ["train.on_nonfinite=stop", "train.max_consecutive_skips=2", "train.steps=4", "train.save_every=0",
        "rl.kl_coeff=0.1"]
MESSAGE = ("meshlm rl: stopped: step 2: 2 steps in a row had a non-finite loss or gradient "
           "(train.max_consecutive_skips=2); stopping (no checkpoint exists)")


@pytest.fixture(scope="module")
def poisoned_reference(tmp_path_factory, policy_folder) -> Path:
    """The policy's weights with one nan: a corrupt reference model."""
    root = tmp_path_factory.mktemp("poisoned")
    model = LanguageModel(ModelConfig(**MODEL), seed=3)
    with torch.no_grad():
        next(parameter for name, parameter in model.named_parameters() if "embed" in name)[5, 0] = float("nan")
    return save_model(model, root / "model", tokenizer_dir=policy_folder.parent / "tokenizer")


def test_a_non_finite_stop_exits_1_with_the_reason(policy_folder, poisoned_reference, tmp_path, capsys):
    run_dir = tmp_path / "run"
    overrides = rl_overrides(policy_folder, run_dir, *STOP, f"rl.reference_from={poisoned_reference}")
    assert main(["rl", *overrides]) == 1
    captured = capsys.readouterr()
    assert MESSAGE in captured.err
    assert "meshlm rl: done" not in captured.out
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward_mean" in r]
    assert [(r["step"], r["skipped_steps"]) for r in records] == [(1, 1), (2, 2)]  # both steps skipped
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())


def stopped_rank(policy: str, reference: str, root: str) -> tuple[int, str]:
    """In each spawned rank: `meshlm rl` at dp=2 with the corrupt reference; (exit status, stderr).
    The command's own teardown of the process group is left to the test harness."""
    import meshlm.training.cli as training_cli

    training_cli.leave_process_group = lambda: None
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        status = main(["rl", *rl_overrides(Path(policy), Path(root) / "dp2", *STOP, "parallel.dp=2",
                                           f"rl.reference_from={reference}")])
    return status, stderr.getvalue()


def test_every_data_parallel_rank_stops_alike_and_rank_0_says_why(policy_folder, poisoned_reference, tmp_path):
    (status_0, err_0), (status_1, err_1) = run_distributed(stopped_rank, 2, str(policy_folder),
                                                           str(poisoned_reference), str(tmp_path), timeout_s=240)
    assert (status_0, status_1) == (1, 1)
    assert MESSAGE in err_0 and "stopped" not in err_1


def test_pass_at_k_reports_sampled_figures_that_hand_counting_reproduces(policy_folder, tmp_path, capsys):
    overrides = rl_overrides(policy_folder, tmp_path / "run", "train.reward_fn=tests.rl.rewards:sevens",
                             "rl.kl_coeff=0")
    assert main(["rl", *overrides, "--eval-only", "--pass-at", "4"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["samples"] == 4 and report["prompts"] == 8
    # by hand: the 8 held-out prompts' 4 samples each in one batch (HELD_OUT_SAMPLING_BATCH = 16), judged one by one
    from meshlm.config import load_run_config
    from meshlm.inference.generate import generate
    from meshlm.inference.sampling import SamplingConfig
    from meshlm.rl.loop import HELD_OUT_SAMPLING_STEP
    from meshlm.rl.rollouts import group_seed

    trainer = GRPOTrainer(load_run_config(None, overrides))
    trainer.environment.is_correct = lambda record, text: "7" in text  # a judgement random replies often meet
    records = trainer.environment.held_out
    sampling = SamplingConfig(temperature=1.0, seed=group_seed(trainer.config.train.seed, HELD_OUT_SAMPLING_STEP, 0))
    replies = generate(trainer.model, [trainer.encode_prompt(record) for record in records for _ in range(4)],
                       6, sampling, eos_token_id=trainer.stop_ids, pad_token_id=trainer.pad_token_id,
                       valid_vocab_size=trainer.valid_vocab_size)
    hits = ["7" in trainer.tokenizer.decode([t for t in ids if t not in trainer.stop_ids]) for ids in replies]
    correct, solved = sum(hits), sum(any(hits[4 * prompt:4 * prompt + 4]) for prompt in range(8))
    assert trainer.held_out_pass_at_k(4) == (correct, solved, 8)
    assert 0 <= report["sampled_pass_at_1"] <= report["pass_at_4"] <= 1
    assert 0 < correct < 32 and correct / 32 <= solved / 8  # the judgement is met sometimes, not always
    trainer.batches.close()


def test_pass_at_needs_eval_only(policy_folder, tmp_path, capsys):
    assert main(["rl", *rl_overrides(policy_folder, tmp_path / "run"), "--pass-at", "4"]) == 2
    assert "--pass-at 4: give a number of samples >= 1, together with --eval-only." in capsys.readouterr().err


def test_a_step_out_of_memory_exits_1_with_the_trainers_sentence(policy_folder, tmp_path, capsys, monkeypatch):
    """GRPO's step 2 fails as the CPU allocator fails a request for 1 PiB: `meshlm rl` says what
    ran out and what to change in one line, as `meshlm train` does (meshlm/training/out_of_memory.py)."""
    take_step = GRPOTrainer.train_step

    def step_that_runs_out(trainer):
        if trainer.state.step == 1:
            raise RuntimeError(cpu_allocator_refusal())  # the allocator's message, made in a process of its own
        return take_step(trainer)

    monkeypatch.setattr(GRPOTrainer, "train_step", step_that_runs_out)
    overrides = rl_overrides(policy_folder, tmp_path / "run", "train.steps=3", "train.save_every=0")
    assert main(["rl", *overrides]) == 1
    captured = capsys.readouterr()
    last = captured.err.splitlines()[-1]
    assert last.startswith("meshlm rl: error: out of memory on cpu in step 2 (a request for 1.02e+03 TiB failed). "
                           "The estimated peak of this process is "), last
    assert "Traceback" not in captured.err and "meshlm rl: done" not in captured.out
