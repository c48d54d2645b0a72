"""Numerical precision of training: fp32 master weights for bf16/fp16 runs (mixed_precision.py)
and fp16's dynamic loss scaler (loss_scaler.py)."""

from meshlm.precision.loss_scaler import DynamicLossScaler
from meshlm.precision.mixed_precision import MixedPrecision

__all__ = ["DynamicLossScaler", "MixedPrecision"]
