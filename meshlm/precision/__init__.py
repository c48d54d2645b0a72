"""Numerical precision of training: fp32 master weights for bf16/fp16 runs (mixed_precision.py),
fp16's dynamic loss scaler (loss_scaler.py) and what a device gets by default (device_defaults.py:
``precision.dtype: auto``)."""

from meshlm.precision.loss_scaler import DynamicLossScaler
from meshlm.precision.mixed_precision import MixedPrecision

__all__ = ["DynamicLossScaler", "MixedPrecision"]
