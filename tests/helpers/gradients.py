"""Comparing a computation with a reference written out: values and every input's gradient."""

from __future__ import annotations

import torch


def assert_same_with_gradients(ours: torch.Tensor, expected: torch.Tensor, inputs: list[torch.Tensor],
                               atol: float = 1e-12) -> None:
    """``ours`` equals ``expected`` (fp64: to 1e-12), and so do their gradients with respect to each of
    ``inputs`` under the same random output gradient."""
    grad_out = torch.randn(ours.shape, generator=torch.Generator().manual_seed(9), dtype=ours.dtype)
    torch.testing.assert_close(ours, expected, rtol=0, atol=atol)
    for actual, wanted in zip(torch.autograd.grad(ours, inputs, grad_out), torch.autograd.grad(expected, inputs,
                                                                                               grad_out)):
        torch.testing.assert_close(actual, wanted, rtol=0, atol=atol)


__all__ = ["assert_same_with_gradients"]
