"""What the GPU tier's trainer runs share: the model kinds, the tier's size and the overrides that
put a run on a device in a given precision.

The trainer runs are those of tests/training/test_parallel_training.py (``train_once``,
``assert_same_run``, the tiny counting corpus), loaded once as ``parallel_training_helpers``;
this module only adds the GPU tier's sizes and device settings on top of their overrides.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers.distributed import import_test_file

HELPERS = import_test_file(Path(__file__).parents[1] / "training" / "test_parallel_training.py",
                           "parallel_training_helpers")
"""tests/training/test_parallel_training.py's run helpers (test files cannot import each other)."""


SIZE = ["model.hidden_size=64", "model.ffn_hidden_size=128", "train.seq_len=32"]
"""The tier's tiny size (4 heads of 16: a head dim the CUDA flash kernel takes), over the helpers' base."""

HYBRID = ["model.pattern=M*-M", "model.mamba_head_dim=16", "model.mamba_state_size=16", "model.mamba_num_groups=2",
          "model.mamba_chunk_size=16"]
"""Mamba + attention with shapes the Triton SSD kernels take (head dim, state >= 16, chunk 16), so
``model.mamba_scan=auto`` runs them on CUDA (the PyTorch scan on CPU)."""

MODEL_KINDS = {
    "dense": HELPERS.MODELS["dense"],
    "hybrid": HYBRID,
    "moe": HELPERS.MODELS["moe"],
    "mtp": [*HELPERS.MODELS["dense"], "model.mtp_depth=1"],
}
"""The four model kinds of issue 14, as overrides of the helpers' run config."""


def on_device(device: torch.device, dtype: str) -> list[str]:
    """Overrides that run a trainer on ``device`` in ``dtype``. An fp32 run on CUDA turns TF32 off
    (``precision.tf32=false``): it is compared with other fp32 runs at 1e-5, and TF32's 10-bit
    products would put the difference at ~1e-3 (meshlm/precision/device_defaults.py)."""
    overrides = [f"train.device={device}", f"precision.dtype={dtype}"]
    if dtype == "fp32":
        overrides.append("precision.tf32=false")
    return overrides


def losses_in_order(run: dict, key: str = "losses") -> list[float]:
    """A run's losses (``losses`` or ``val_losses``) in step order."""
    return [run[key][step] for step in sorted(run[key])]


LOSS_TOLERANCE = 2e-2
"""The largest relative gap, per step, between the losses of a bf16 run and of the same training
rounded otherwise (fp32 on the CPU, or compiled bf16); tests/gpu/test_model_kinds.py explains it."""
FIRST_STEP_TOLERANCE = 5e-3
"""The same at the first step, which depends only on the initial weights and one forward."""


def relative_gaps(actual: dict, expected: dict, key: str = "losses") -> list[float]:
    """|actual - expected| / |expected| per step of two runs' ``key`` losses, in step order."""
    return [abs(a - e) / abs(e) for a, e in zip(losses_in_order(actual, key), losses_in_order(expected, key))]


__all__ = ["FIRST_STEP_TOLERANCE", "HELPERS", "HYBRID", "LOSS_TOLERANCE", "MODEL_KINDS", "SIZE", "losses_in_order",
           "on_device", "relative_gaps"]
