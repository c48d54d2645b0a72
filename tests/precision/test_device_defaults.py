"""precision.dtype auto (bf16 on CUDA, fp32 on CPU, resolved once) and precision.tf32 (CUDA fp32 only)."""

from __future__ import annotations

import pytest
import torch

from meshlm.config import PrecisionConfig
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel
from meshlm.precision.device_defaults import configure_tf32, resolve_dtype, resolve_precision
from meshlm.precision.mixed_precision import MixedPrecision


def test_auto_is_bf16_on_cuda_and_fp32_elsewhere():
    assert resolve_dtype("auto", torch.device("cpu")) == "fp32"
    assert resolve_dtype("auto", torch.device("cuda", 0)) == "bf16"  # a device name needs no GPU
    assert resolve_dtype("auto", "cuda") == "bf16"


@pytest.mark.parametrize("name", ["fp32", "bf16", "fp16"])
def test_explicit_dtypes_are_kept_on_every_device(name):
    assert resolve_dtype(name, torch.device("cpu")) == resolve_dtype(name, torch.device("cuda")) == name


def test_resolve_precision_copies_the_section():
    config = PrecisionConfig(dtype="auto", initial_loss_scale=8.0)
    resolved = resolve_precision(config, torch.device("cpu"))
    assert resolved.dtype == "fp32" and resolved.initial_loss_scale == 8.0
    assert config.dtype == "auto"  # the caller's config is left as it was


def test_mixed_precision_resolves_auto_against_the_model_device():
    model = LanguageModel(ModelConfig(vocab_size=64, hidden_size=32, pattern="*-", num_attention_heads=4))
    precision = MixedPrecision(model, PrecisionConfig())  # the default is 'auto'
    assert PrecisionConfig().dtype == "auto"
    assert precision.dtype_name == "fp32" and not precision.low_precision
    assert all(param.dtype == torch.float32 for param in model.parameters())


@pytest.fixture
def tf32_flags():
    """The process-wide TF32 switches, restored after the test."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_tf32_is_left_alone_off_cuda(tf32_flags, dtype):
    for before in (False, True):
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = before
        assert configure_tf32(torch.device("cpu"), dtype, enabled=not before) is False
        assert torch.backends.cuda.matmul.allow_tf32 is before and torch.backends.cudnn.allow_tf32 is before


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_tf32_follows_the_switch_on_cuda_for_every_dtype(tf32_flags, dtype):
    """A bf16 or fp16 run's fp32 matmuls (the SSD scan's state products, the router) get TF32 too.
    Only the flags are set (no CUDA call), so this runs on a CPU-only build too."""
    assert configure_tf32(torch.device("cuda", 0), dtype, enabled=True) is True
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert configure_tf32(torch.device("cuda", 0), dtype, enabled=False) is False
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
