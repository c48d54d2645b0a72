"""bench/low_precision.py's timed trainer: every step timed, one in the middle profiled instead.

The bench itself trains the demo model under each recipe for minutes; here a tiny run shows what
``--profile TOP`` adds to a run's record and that the profiled step stays out of the timings.
"""

import pytest

from bench.low_precision import TimedTrainer, parse_args
from tests.helpers.trainer_runs import load_parallel_training_helpers

helpers = load_parallel_training_helpers()


def test_one_step_in_the_middle_is_profiled_and_not_timed(tmp_path):
    blend = helpers.write_tiny_corpus(tmp_path / "corpus")
    config = helpers.run_config(blend, tmp_path / "run", "train.steps=4", "parallel.check_collectives=false")
    trainer = TimedTrainer(config, profile_top=3)
    losses = trainer.run().losses
    assert sorted(losses) == [1, 2, 3, 4]  # the profiled step trained like the others
    assert len(trainer.step_seconds) == len(trainer.step_cpu_seconds) == 3  # step 3 (of 4) went to the profiler
    profile = trainer.profile
    assert profile["measured"] == "self_cpu_time_total" and len(profile["top"]) == 3
    milliseconds = [operator["ms"] for operator in profile["top"]]
    assert milliseconds == sorted(milliseconds, reverse=True) and 0 < sum(milliseconds) <= profile["total_ms"]
    assert profile["regions_ms"]["optimizer"] > 0  # the step's optimizer update was inside the profile


def test_without_profile_top_every_step_is_timed(tmp_path):
    blend = helpers.write_tiny_corpus(tmp_path / "corpus")
    trainer = TimedTrainer(helpers.run_config(blend, tmp_path / "run", "train.steps=3",
                                              "parallel.check_collectives=false"))
    trainer.run()
    assert len(trainer.step_seconds) == 3 and trainer.profile is None


def test_a_negative_profile_is_refused_with_one_sentence(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--device", "cpu", "--profile", "-1"])
    assert "--profile -1: give how many operators to list (0, the default, profiles nothing)" in capsys.readouterr().err


@pytest.mark.parametrize("model,parameters_b,gemm_share", [("dense", 0.42, 0.89), ("dense_wide", 0.82, 0.93)])
def test_the_dense_speed_models_are_linear_heavy_and_gpu_only(capsys, model, parameters_b, gemm_share):
    """--model dense / dense_wide: the FP8 speed target's Transformers (GPU only); most of their
    FLOPs are the linear layers' GEMMs, which the recipes quantize -- the wide one's more so."""
    import torch

    from bench.low_precision import MODELS
    from meshlm.config import load_run_config
    from meshlm.models.flops import model_flops_per_token
    from meshlm.models.language_model import LanguageModel

    args = parse_args(["--model", model, "--device", "cuda"])
    assert args.shape[1:] == (1024, 8, 4, 8)  # 4 micro-batches of 8 x 1024 tokens a step
    config = load_run_config(None, [*MODELS[model], "train.seq_len=1024"])
    with torch.device("meta"):
        language_model = LanguageModel(config.model)
    linear = sum(module.weight.numel() for module in language_model.modules()  # the blocks' (tied: no head)
                 if isinstance(module, torch.nn.Linear))
    total = sum(parameter.numel() for parameter in language_model.parameters())
    assert abs(total / 1e9 - parameters_b) < 0.01
    assert 6 * linear / model_flops_per_token(config.model, 1024) > gemm_share
    with pytest.raises(SystemExit):
        parse_args(["--model", model, "--device", "cpu"])
    assert f"--model {model} is the GPU speed measurement (use --device cuda)" in capsys.readouterr().err
