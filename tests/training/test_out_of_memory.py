"""A step that runs out of memory (meshlm/training/out_of_memory.py): one sentence with the numbers
and the settings that lower them, exit status 1, the newest checkpoint intact and resumable."""

from __future__ import annotations

import pytest
import torch
import yaml

from meshlm.cli import main
from meshlm.training.out_of_memory import EXIT_OUT_OF_MEMORY, failed_request, is_out_of_memory
from meshlm.training.trainer import Trainer
from tests.helpers.allocation_failure import cpu_allocator_refusal


def cpu_allocation_failure() -> RuntimeError:
    """The CPU allocator's own error for 1 PiB (not a hand-written one), made in a process of its own."""
    return RuntimeError(cpu_allocator_refusal())


CUDA_MESSAGE = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
                "1.06 GiB is free. Including non-PyTorch memory, this process has 78.12 GiB memory in use.")
"""torch's message for a CUDA allocation that failed (c10/cuda/CUDACachingAllocator.cpp), as raised on an H100."""


def test_allocator_failures_are_told_from_other_errors():
    cpu = cpu_allocation_failure()
    assert is_out_of_memory(cpu) and failed_request(cpu) == "1.02e+03 TiB"
    cuda = torch.OutOfMemoryError(CUDA_MESSAGE)
    assert is_out_of_memory(cuda) and failed_request(cuda) == "2.00 GiB"
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)"))
    assert not is_out_of_memory(ValueError("can't allocate memory: you tried to allocate 8 bytes"))


def test_a_step_out_of_memory_says_what_to_change_and_the_rerun_resumes(make_config, tmp_path, capsys,
                                                                         monkeypatch):
    """Step 3 of 4 fails as the CPU allocator fails a request for 1 PiB, after step 2's checkpoint:
    the command exits with status 1 and one sentence; the same command without the failure resumes
    at step 2."""
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(make_config("train.steps=4", "train.eval_every=0").to_dict()))
    take_step = Trainer.train_step

    def step_that_runs_out(trainer):
        if trainer.state.step == 2:
            raise cpu_allocation_failure()
        return take_step(trainer)

    monkeypatch.setattr(Trainer, "train_step", step_that_runs_out)
    assert main(["train", str(config_file)]) == EXIT_OUT_OF_MEMORY
    captured = capsys.readouterr().err
    run_dir = tmp_path / "run"
    assert "Traceback" not in captured and "step 2: saved" in captured, captured
    error = captured.splitlines()[-1]  # after the progress lines: one sentence
    assert error.startswith("meshlm train: error: out of memory on cpu in step 3 (a request for 1.02e+03 TiB "
                            "failed). The estimated peak of this process is "), error
    for said in ("weights ", "optimizer state ", "activations ", "lower train.micro_batch_size (2) or "
                 "train.seq_len (16), set train.recompute=full (now none)", "parallel.zero_stage (now 0",
                 "`meshlm plan CONFIG.yaml --gpus N`", f"{run_dir / 'checkpoints' / 'step_2'} is intact, and rerunning "
                 "with the changes resumes from it."):
        assert said in error, (said, error)
    assert sorted(path.name for path in (run_dir / "checkpoints").glob("step_*")) == ["step_2"]

    monkeypatch.setattr(Trainer, "train_step", take_step)
    assert main(["train", str(config_file)]) == 0
    out = capsys.readouterr().out
    assert "done: step 4/4" in out and (run_dir / "checkpoints" / "step_4" / "complete.json").is_file()


def test_out_of_memory_before_any_checkpoint_says_so(make_config, monkeypatch):
    """Through the Python API: ``meshlm.train`` raises OutOfMemoryStop, chained to torch's error."""
    from meshlm.training.out_of_memory import OutOfMemoryStop

    config = make_config("train.steps=2", "train.eval_every=0", "train.save_every=0")

    def step_that_runs_out(trainer):
        raise torch.OutOfMemoryError(CUDA_MESSAGE)

    monkeypatch.setattr(Trainer, "train_step", step_that_runs_out)
    with pytest.raises(OutOfMemoryStop) as stopped:
        Trainer(config).run()
    assert isinstance(stopped.value.__cause__, torch.OutOfMemoryError)
    assert str(stopped.value).startswith("out of memory on cpu in step 1 (a request for 2.00 GiB failed). ")
    assert str(stopped.value).endswith(f"no checkpoint had been saved in {config.train.run_dir} yet.")


def test_out_of_memory_in_the_validation_after_a_step_says_so(make_config, monkeypatch):
    """The validation after step 2 runs out (the CPU allocator's refusal): the sentence says
    where, rather than naming step 3, which never began."""
    from meshlm.training.out_of_memory import OutOfMemoryStop

    config = make_config("train.steps=4", "train.eval_every=2", "train.save_every=0")
    evaluate = Trainer.maybe_evaluate

    def evaluation_that_runs_out(trainer, *args, **kwargs):
        if trainer.state.step == 2:
            raise cpu_allocation_failure()
        return evaluate(trainer, *args, **kwargs)

    monkeypatch.setattr(Trainer, "maybe_evaluate", evaluation_that_runs_out)
    with pytest.raises(OutOfMemoryStop, match=r"^out of memory on cpu after step 2, in its validation, "
                                              r"checkpoint or logging \(a request for 1.02e\+03 TiB failed\)\. "):
        Trainer(config).run()
