"""Mamba-2's gated, grouped RMSNorm: recomputed in backward, its gradients equal autograd's of the formula."""

import pytest
import torch
import torch.nn.functional as F

from meshlm.models.norms import GatedRMSNorm
from tests.helpers.saved_tensors import SavedStorages


def formula(y, gate, weight, group_size, eps):
    gated = (y * F.silu(gate)).unflatten(-1, (-1, group_size))
    return weight * (gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)


@pytest.mark.parametrize("group_size", [4, 12])
def test_gated_rms_norm_values_and_gradients(group_size):
    generator = torch.Generator().manual_seed(group_size)
    norm = GatedRMSNorm(12, group_size=group_size).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=generator)
    y = torch.randn(2, 5, 12, generator=generator, dtype=torch.float64, requires_grad=True)
    gate = torch.randn(2, 5, 12, generator=generator, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(2, 5, 12, generator=generator, dtype=torch.float64)
    leaves = (y, gate, norm.weight)
    fused = norm(y, gate)
    fused_grads = torch.autograd.grad((fused * grad_out).sum(), leaves)
    expected = formula(y, gate, norm.weight, group_size, norm.eps)
    expected_grads = torch.autograd.grad((expected * grad_out).sum(), leaves)
    torch.testing.assert_close(fused, expected, rtol=1e-12, atol=1e-12)
    for actual, wanted in zip(fused_grads, expected_grads):
        torch.testing.assert_close(actual, wanted, rtol=1e-12, atol=1e-12)


def test_gated_rms_norm_keeps_the_input_dtype():
    norm = GatedRMSNorm(8, group_size=4).bfloat16()
    out = norm(torch.randn(3, 8, dtype=torch.bfloat16), torch.randn(3, 8, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16


def test_gated_rms_norm_saves_only_its_inputs():
    norm = GatedRMSNorm(16, group_size=8)
    y, gate = torch.randn(4, 16, requires_grad=True), torch.randn(4, 16, requires_grad=True)
    with SavedStorages() as saved:
        norm(y, gate)
    assert saved.pointers == {tensor.untyped_storage().data_ptr() for tensor in (y, gate, norm.weight)}
