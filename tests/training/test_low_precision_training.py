"""Low-precision recipes in the trainer (precision.recipe): every recipe trains the hybrid and the
MoE tiny models in bf16 with finite, falling losses; a recipe on fp32 and bad recipe settings are
refused before training starts, naming the fields.

(The trainer-run helpers are those of tests/training/test_parallel_training.py, loaded by path with
tests/helpers/trainer_runs.py: test files cannot import each other.)
"""

from __future__ import annotations

import math
import shutil

import pytest

from meshlm.errors import ConfigError
from meshlm.precision.quantized_linear import QuantizedLinear
from meshlm.training.trainer import Trainer
from tests.helpers.trainer_runs import load_parallel_training_helpers

helpers = load_parallel_training_helpers()
RECIPE_NAMES = ["fp8_tensorwise", "fp8_delayed", "fp8_blockwise", "mxfp8", "nvfp4"]
STEPS = ["train.steps=8", "optim.lr=3e-3", "optim.warmup_steps=1", "parallel.check_collectives=false"]


@pytest.fixture(scope="module")
def blend(tmp_path_factory):
    return helpers.write_tiny_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.mark.parametrize("model", ["hybrid", "moe"])
@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_each_recipe_trains_with_falling_loss(blend, tmp_path, model, recipe):
    config = helpers.run_config(blend, tmp_path / "run", *helpers.MODELS[model], *STEPS, "precision.dtype=bf16",
                                f"precision.recipe={recipe}")
    trainer = Trainer(config)
    quantized = [module for module in trainer.model.modules() if isinstance(module, QuantizedLinear)]
    assert quantized and all(module.quantization.recipe.name == recipe for module in quantized)
    losses = trainer.run().losses
    values = [losses[step] for step in sorted(losses)]
    assert all(math.isfinite(value) for value in values), values
    assert sum(values[-3:]) / 3 < sum(values[:3]) / 3, values


def test_high_precision_layers_keep_the_ends_out(blend, tmp_path):
    config = helpers.run_config(blend, tmp_path / "run", *helpers.MODELS["hybrid"], "precision.dtype=bf16",
                                "precision.recipe=mxfp8", "precision.high_precision_layers=1")
    trainer = Trainer(config)
    blocks = {name.split(".")[1] for name, module in trainer.model.named_modules() if isinstance(module, QuantizedLinear)}
    assert blocks == {"1", "2"}  # of the four blocks of M*-M


@pytest.mark.parametrize("overrides, message", [
    (["precision.dtype=fp32"], "precision.recipe=nvfp4 quantizes the GEMMs of a bf16 run, but precision.dtype is fp32"),
    (["precision.dtype=bf16", "precision.amax_history=0"], "precision.amax_history=0 must be an integer >= 1"),
    (["precision.dtype=bf16", "precision.fp8_gemm=fast"], "precision.fp8_gemm"),
    (["precision.dtype=bf16", "precision.fp8_fast_accumulation=forward"],
     "precision.fp8_fast_accumulation='forward' is not one of fprop, none, all"),
])
def test_recipe_refused_on_other_dtypes_and_bad_settings(blend, tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):  # from the config's checks or the trainer's
        Trainer(helpers.run_config(blend, tmp_path / "run", *helpers.MODELS["hybrid"], "precision.recipe=nvfp4",
                                   *overrides))


def test_hardware_fp8_gemms_train_in_the_trainer(blend, tmp_path):
    """precision.fp8_gemm=hardware: every quantized layer multiplies FP8 codes (torch._scaled_mm,
    which this CPU build runs for per-tensor scales), and the run trains with falling loss."""
    config = helpers.run_config(blend, tmp_path / "run", *helpers.MODELS["hybrid"], *STEPS, "precision.dtype=bf16",
                                "precision.recipe=fp8_delayed", "precision.fp8_gemm=hardware")
    trainer = Trainer(config)
    quantized = [module for module in trainer.model.modules() if isinstance(module, QuantizedLinear)]
    assert quantized and all(module.quantization.hardware for module in quantized)
    losses = trainer.run().losses
    values = [losses[step] for step in sorted(losses)]
    assert all(math.isfinite(value) for value in values), values
    assert sum(values[-3:]) / 3 < sum(values[:3]) / 3, values


def test_hardware_fp8_delayed_resumes_bitwise_across_evaluations(blend, tmp_path):
    """fp8_delayed on the FP8 GEMM, four micro-batches a step (each weight cast once a step,
    ``keeping_weight_codes``) and an evaluation after every step: a run resumed from its step-2
    checkpoint repeats steps 3 and 4 bit for bit. The validation passes must leave the amax
    histories alone -- the checkpoint does not hold a step's running amax, so an evaluation that
    recorded into it would make the uninterrupted run differ from the resumed one."""
    overrides = [*helpers.MODELS["hybrid"], "train.steps=4", "train.eval_every=1", "train.save_every=2",
                 "precision.dtype=bf16", "precision.recipe=fp8_delayed", "precision.fp8_gemm=hardware",
                 "parallel.check_collectives=false"]
    full = Trainer(helpers.run_config(blend, tmp_path / "full", *overrides)).run()
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step_2", tmp_path / "resumed" / "checkpoints" / "step_2")
    resumed = Trainer(helpers.run_config(blend, tmp_path / "resumed", *overrides)).run()
    assert sorted(resumed.losses) == [3, 4]
    assert [resumed.losses[step] for step in (3, 4)] == [full.losses[step] for step in (3, 4)]
    assert [resumed.val_losses[step] for step in (3, 4)] == [full.val_losses[step] for step in (3, 4)]
