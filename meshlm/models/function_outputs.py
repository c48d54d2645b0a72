"""Outputs of a custom autograd Function that ``torch.compile`` on torch 2.11 differentiates.

Dynamo traces a ``torch.autograd.Function`` into one higher-order op whose forward graph, on
torch 2.11, returns the Function's outputs *and every intermediate tensor* (the backward graph
takes them as unused inputs). When a returned tensor is the same tensor object as one of those
intermediates -- the result of an in-place op (``torch.empty(...).copy_(y)``, ``y += ...``,
``out=``), or a no-op ``.contiguous()`` / ``.to(dtype)`` / ``.float()`` of a tensor computed
just before -- the op's outputs hold that tensor twice. Autograd then connects the tensor the
caller receives to the later slot, an unused one, and the Function's backward gets zeros for
the output the caller differentiated: every gradient that flows through it is silently lost,
with no error and a loss that still falls (the other paths still learn). Eagerly nothing of
this happens, and torch 2.13's Dynamo returns only the outputs (the GPU image has 2.11).

Seen in meshlm: the Mamba-2 scan (``ssd_fast._ChunkedScan``) returned its output through
``torch.empty(...).copy_(y)`` on the PyTorch path and through ``y.contiguous()`` on the Triton
path, and the gated norm (``norms._SkipGatedRMSNorm``) through ``.to(out_dtype)``, a no-op in an
fp32 run: under ``train.compile=true`` on torch 2.11 every Mamba block's x, B, C, dt, A and
everything before them trained without the scan's gradient.

``distinct_output`` is what such a Function returns instead: under compilation a view of the
tensor -- a new tensor object, no copy -- and eagerly the tensor itself, so eager autograd's
rules for views returned by a Function (no later in-place op on them) do not apply.
``tests/training/test_compile.py`` checks that every Function traced into a compiled block returns
tensors of its own, reading the traced graphs (``tests/helpers/compiled_graphs.py``), so the check
holds on any torch; the GPU tier compares each parameter's compiled gradient with the eager one.
"""

from __future__ import annotations

import torch


def distinct_output(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, as a tensor object no other node of a compiled graph holds (module docstring)."""
    if torch.compiler.is_compiling():
        return tensor.view_as(tensor)
    return tensor


__all__ = ["distinct_output"]
