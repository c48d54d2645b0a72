"""Which fused kernel ``scaled_dot_product_attention`` runs: ``model.attention_kernel``.

On a CUDA GPU, PyTorch's SDPA has four implementations of the same function -- FlashAttention-2
(``flash``), cuDNN's fused attention (``cudnn``), the memory-efficient kernel of xFormers
(``efficient``) and the unfused reference (``math``) -- and picks the first in a fixed priority
order that accepts the call's shapes and dtypes. Which is fastest depends on the GPU: on Hopper
(compute capability 9.x: H100, H200) cuDNN has attention kernels written for that generation,
which FlashAttention-2 predates; a transformers pull request (48163, 2026) measured them at
1.7-2.3x FlashAttention-2's speed on training shapes on both H100 and H200, and slower on Ampere
and Blackwell. PyTorch itself puts cuDNN first on
Hopper only from cuDNN 9.15.1 on (``check_prefer_cudnn_attention`` in ATen's ``sdp_utils.cpp``),
so which kernel a run gets has depended on the torch build rather than the GPU.

``model.attention_kernel`` makes the choice explicit. It is a *preference*, not a restriction:
the named kernel goes first and the others follow in PyTorch's order, so a call the kernel cannot
serve (a head size, a mask, a dtype it lacks) still runs, on the next kernel that can:

- ``auto``: cuDNN first on a Hopper GPU, PyTorch's own order on other GPUs;
- ``flash``, ``cudnn``, ``efficient``, ``math``: that kernel first, on any GPU.

On a CPU the field has no effect: PyTorch's CPU attention takes no priorities (it runs its own
flash kernel where it can, else the math one).

All compute the same function up to rounding, so the choice is a training-only field (a checkpoint
resumes under another). The trainer sets it for its process when it starts, as it sets TF32
(``prefer_attention_kernel``): SDPA's priority order is PyTorch's own process-wide setting, and
setting it there rather than inside each attention call keeps it out of compiled graphs (Dynamo
cannot read SDPA's switches) and applies it alike to the forward, the recomputation of selective
recompute and the backward. Only the order changes: a kernel switched off (``sdpa_kernel`` around a
call, ``torch.backends.cuda.enable_*_sdp(False)``) stays off. Ring attention (context parallelism)
computes its blocks itself and takes no preference: a named kernel there is refused.
``bench/attention_kernels.py`` times every kernel on the dense 1B shape (``bench/gpu_throughput.py``
records it as ``attention_kernels``), so the choice for a GPU rests on a measurement.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from meshlm.models.config import ATTENTION_KERNELS

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}

TORCH_ORDER = ("flash", "efficient", "math", "cudnn")
"""PyTorch's default priority on CUDA (``sdp_utils.cpp``) where it does not put cuDNN first; the
kernels after the preferred one follow it."""

CUDNN_FIRST_CAPABILITY = 9
"""The GPU generation (compute capability major) where ``auto`` puts cuDNN first: Hopper."""

PRIORITY_SUPPORTED = "set_priority" in inspect.signature(sdpa_kernel).parameters
"""SDPA's priority order (``torch._C._set_sdp_priority_order``, behind ``sdpa_kernel(...,
set_priority=True)``) came with torch 2.6; on older torch every choice runs PyTorch's own order."""


def preferred_order(kernel: str, device: torch.device) -> list[SDPBackend] | None:
    """The kernels in the order SDPA should try them for ``kernel`` on ``device``; None for PyTorch's
    own order (a CPU, ``auto`` off Hopper, or a torch without priorities)."""
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"attention kernel {kernel!r} is not one of {', '.join(ATTENTION_KERNELS)}")
    if not PRIORITY_SUPPORTED or device.type != "cuda":
        return None
    if kernel == "auto":
        if torch.cuda.get_device_capability(device)[0] != CUDNN_FIRST_CAPABILITY:
            return None
        kernel = "cudnn"
    return [BACKENDS[kernel]] + [BACKENDS[name] for name in TORCH_ORDER if name != kernel]


def prefer_attention_kernel(kernel: str, device: torch.device) -> list[str] | None:
    """Put ``kernel``'s order (``preferred_order``) into effect for this process's SDPA calls;
    returns the kernels' names in the order now in force, or None where PyTorch's own order stays."""
    order = preferred_order(kernel, device)
    if order is None:
        return None
    settled_priority_order(device)  # so that ours is set after torch's default, and stays
    return set_priority_order(order)


def settled_priority_order(device: torch.device) -> list[int]:
    """SDPA's priority order (``SDPBackend`` codes) as torch has settled it on ``device``. torch
    settles its default at its first SDPA call on a GPU, replacing any order set before; so one
    tiny call is made first."""
    tiny = torch.zeros(1, 1, 8, 64, device=device, dtype=torch.bfloat16)
    F.scaled_dot_product_attention(tiny, tiny, tiny, is_causal=True)
    return torch._C._get_sdp_priority_order()


def set_priority_order(order: list[SDPBackend]) -> list[str]:
    """SDPA's process-wide priority: ``order`` first, then the rest of the current order (as
    ``sdpa_kernel(..., set_priority=True)`` sets it, without switching kernels on or off); returns
    the names of meshlm's four kernels in the order now in force."""
    codes = [int(backend) for backend in order]
    codes += [code for code in torch._C._get_sdp_priority_order() if code not in codes]
    torch._C._set_sdp_priority_order(codes)
    names = {int(backend): name for name, backend in BACKENDS.items()}
    return [names[code] for code in torch._C._get_sdp_priority_order() if code in names]
