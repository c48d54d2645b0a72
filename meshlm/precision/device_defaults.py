"""What precision a run gets on its device when the config does not say: ``precision.dtype: auto``.

A GPU since Ampere does its matmuls in bf16 on tensor cores at about 15x its plain-fp32 rate
(A100 and H100 data sheets), and bf16 has fp32's exponent range, so it needs no loss scaling
(``mixed_precision.py`` keeps fp32 masters): ``auto`` means bf16 on CUDA. A CPU has no such
fast path in most builds (bf16 matmuls often run slower than fp32 there), so ``auto`` means fp32
on CPU. The choice is made once, at start-up, against the device the run resolved
(``meshlm.training.trainer.resolve_device``), and the resolved name is what every later piece
sees and what the run's logs and checkpoints record.

fp32 matmuls on CUDA can still use tensor cores through TF32 (fp32's range with a 10-bit mantissa
for the products, fp32 accumulation; NVIDIA's A100 white paper, 2020): about 7x the plain-fp32
matmul rate on an H100, with training curves that match fp32's in practice. ``precision.tf32``
(default on) lets PyTorch's CUDA matmuls and cuDNN convolutions use it. In an fp32 run that is
every matmul. A bf16 or fp16 run has a few matmuls kept in fp32 on purpose, and they need it as
much: the Mamba-2 SSD scan's chunk-state products and state reads (``ssd_fast.py``, about 250
GFLOP a block forward and backward at the 1B hybrid's shape, 8 x 4096 tokens: at an H200's 67
TFLOP/s of plain fp32 some 5 ms a block, while its bf16 GEMMs run at 15x that rate; the first
H200 profile of the compiled hybrid came with Inductor's warning that TF32 was off) and the MoE
router's logits. TF32 keeps them well above bf16's precision (10 mantissa bits, not 7; the SSD's
bf16 operands pass exactly). The switch is process-wide, so it is set at the trainer's start,
for any dtype, where the device is CUDA; on CPU PyTorch's settings are left alone.
``meshlm.training.metrics.peak_flops`` reads the same switch to pick the TF32 or the FP32 peak of
an fp32 run.
"""

from __future__ import annotations

import dataclasses

import torch

from meshlm.errors import ConfigError


def parse_device(name: str) -> torch.device:
    """``train.device`` as a torch device: 'auto' is cuda where CUDA is available, else cpu; a name
    torch does not know is refused naming the field."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        return torch.device(name)
    except RuntimeError as error:
        raise ConfigError(f"train.device={name!r} is not a torch device; use auto, cpu, cuda or cuda:N.") from error


def resolve_dtype(name: str, device: torch.device) -> str:
    """``precision.dtype`` as the run will use it: 'auto' becomes 'bf16' on CUDA, 'fp32' elsewhere."""
    if name != "auto":
        return name
    return "bf16" if torch.device(device).type == "cuda" else "fp32"


def resolve_precision(config, device: torch.device):
    """A copy of a ``PrecisionConfig`` with its dtype resolved for ``device`` (the input is not changed)."""
    return dataclasses.replace(config, dtype=resolve_dtype(config.dtype, device))


def configure_tf32(device: torch.device, dtype: str, enabled: bool) -> bool:
    """Allow (or forbid) TF32 for a CUDA run's fp32 matmuls and convolutions (all of an fp32 run's,
    those kept in fp32 in a bf16 or fp16 run: module docstring); True when TF32 is now on.

    Does nothing unless ``device`` is CUDA (a CPU run never touches the CUDA backends' flags) and
    ``dtype`` is resolved (fp32, bf16 or fp16: every one gets the same switch; 'auto' is not a dtype
    yet, ``resolve_dtype``).
    """
    if torch.device(device).type != "cuda" or dtype not in ("fp32", "bf16", "fp16"):
        return False
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    return enabled


__all__ = ["configure_tf32", "resolve_dtype", "resolve_precision"]
