"""Mamba-2's gated, grouped RMSNorm with its D skip: a hand-written backward that recomputes from
the inputs, equal to autograd's gradients of the formula, saving the inputs as they came. The
QK-norm of each head (``HeadNorm``): RMSNorm or LayerNorm, a weight shared or per head, against a
loop over heads."""

import pytest
import torch
import torch.nn.functional as F

from meshlm.models.norms import GatedRMSNorm
from tests.helpers.saved_tensors import SavedStorages


def formula(y, gate, weight, group_size, eps, skip=None, skip_scale=None):
    summed = y if skip is None else y + skip_scale * skip
    gated = (summed * F.silu(gate)).unflatten(-1, (-1, group_size))
    return weight * (gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)


def random_case(group_size, with_skip, dtype=torch.float64, seed=0):
    generator = torch.Generator().manual_seed(seed + group_size)
    norm = GatedRMSNorm(12, group_size=group_size).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=generator)
    tensors = [torch.randn(2, 5, 12, generator=generator, dtype=torch.float64).to(dtype).requires_grad_()
               for _ in range(3)]
    scale = (torch.rand(12, generator=generator, dtype=torch.float64) + 0.5).to(dtype).requires_grad_()
    y, gate, skip = tensors
    return norm, y, gate, (skip if with_skip else None), (scale if with_skip else None)


@pytest.mark.parametrize("with_skip", [False, True], ids=["plain", "D-skip"])
@pytest.mark.parametrize("group_size", [4, 12])
def test_gated_rms_norm_values_and_gradients(group_size, with_skip):
    norm, y, gate, skip, scale = random_case(group_size, with_skip)
    grad_out = torch.randn(2, 5, 12, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    leaves = [tensor for tensor in (y, gate, norm.weight, skip, scale) if tensor is not None]
    fused = norm(y, gate, skip, scale)
    fused_grads = torch.autograd.grad((fused * grad_out).sum(), leaves)
    expected = formula(y, gate, norm.weight, group_size, norm.eps, skip, scale)
    expected_grads = torch.autograd.grad((expected * grad_out).sum(), leaves)
    torch.testing.assert_close(fused, expected, rtol=1e-12, atol=1e-12)
    for actual, wanted in zip(fused_grads, expected_grads):
        torch.testing.assert_close(actual, wanted, rtol=1e-12, atol=1e-12)
    with torch.no_grad():  # generation's path, without the autograd function
        torch.testing.assert_close(norm(y, gate, skip, scale), expected, rtol=1e-12, atol=1e-12)


def test_bf16_inputs_are_summed_in_fp32_and_rounded_once():
    """bf16 y, gate and skip (a bf16 run's mixer): the output is the fp32 formula on the same values,
    rounded once to ``out_dtype``, and each gradient comes back in its input's dtype."""
    norm, y, gate, skip, scale = random_case(4, True, dtype=torch.bfloat16)
    out = norm(y, gate, skip, scale, out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    expected = formula(y.double(), gate.double(), norm.weight.double(), 4, norm.eps, skip.double(), scale.double())
    assert torch.equal(out, expected.to(torch.float32).to(torch.bfloat16)) or \
        (out.double() - expected).abs().max() <= 2 ** -8 * expected.abs().max()
    grads = torch.autograd.grad(out.float().sum(), (y, gate, skip, scale, norm.weight))
    assert [grad.dtype for grad in grads] == [torch.bfloat16] * 5
    assert norm(y.float(), gate, skip, scale).dtype == torch.float32  # default: y's dtype


def test_gated_rms_norm_saves_only_its_inputs_and_the_inverse_rms():
    """No fp32 copy of y + D x, the gate or the skip is kept: the inputs as they came, and one
    fp32 number per token and group (the inverse rms)."""
    norm = GatedRMSNorm(16, group_size=8).bfloat16()
    y, gate, skip = (torch.randn(4, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    scale = torch.ones(16, dtype=torch.bfloat16, requires_grad=True)
    with SavedStorages() as saved:
        norm(y, gate, skip, scale, out_dtype=torch.bfloat16)
    inputs = {tensor.untyped_storage().data_ptr() for tensor in (y, gate, skip, scale, norm.weight)}
    assert inputs <= saved.pointers and len(saved.pointers - inputs) == 1
    assert saved.nbytes - sum(tensor.nbytes for tensor in (y, gate, skip, scale, norm.weight)) == 4 * 4 * 2


def test_skip_and_its_scale_come_together():
    norm = GatedRMSNorm(8, group_size=4)
    with pytest.raises(ValueError, match="give skip and skip_scale together"):
        norm(torch.randn(2, 8), torch.randn(2, 8), skip=torch.randn(2, 8))


def test_zero_centered_rms_norm_is_the_ordinary_one_with_weight_plus_one():
    from meshlm.models.norms import RMSNorm

    x = torch.randn(3, 5, 16, dtype=torch.float64)
    centered, ordinary = RMSNorm(16, 1e-6, zero_centered=True).double(), RMSNorm(16, 1e-6).double()
    assert torch.equal(centered.weight, torch.zeros(16, dtype=torch.float64))  # starts at 0: scale 1
    torch.testing.assert_close(centered(x), ordinary(x), rtol=0, atol=0)
    with torch.no_grad():
        centered.weight.normal_(0.0, 0.1)
        ordinary.weight.copy_(centered.weight + 1)
    torch.testing.assert_close(centered(x), ordinary(x), rtol=0, atol=1e-15)


# --- QK-norm over each head (HeadNorm) ------------------------------------------------------------


def reference_qk_norm(x, kind, weight, bias, eps):
    """The per-head norms as transformers writes them: StableLM's ModuleList of one nn.LayerNorm per
    head, Command R's fp32 LayerNorm over [heads, head_dim] weights, Phi's one nn.LayerNorm shared
    by the heads, Qwen3's RMSNorm -- here one loop over heads with torch's own ops."""
    heads = []
    for head in range(x.shape[1]):
        w = weight if weight.dim() == 1 else weight[head]
        b = None if bias is None else (bias if bias.dim() == 1 else bias[head])
        part = x[:, head]
        if kind == "layernorm":
            heads.append(F.layer_norm(part, part.shape[-1:], w, b, eps))
        else:
            heads.append(w * part * torch.rsqrt(part.pow(2).mean(-1, keepdim=True) + eps))
    return torch.stack(heads, dim=1)


@pytest.mark.parametrize("kind, per_head, bias", [
    ("layernorm", True, False), ("layernorm", False, True), ("rmsnorm", True, False), ("layernorm", True, True),
], ids=["stablelm-12b/command-r+", "phi", "rmsnorm-per-head", "layernorm-per-head-biased"])
def test_head_norm_matches_a_norm_per_head_in_values_and_gradients(kind, per_head, bias):
    from meshlm.models.norms import HeadNorm

    generator = torch.Generator().manual_seed(3)
    norm = HeadNorm(kind, 8, 1e-5, heads=3 if per_head else None, bias=bias).double()
    with torch.no_grad():  # trained: every head's row differs
        norm.weight.uniform_(0.5, 1.5, generator=generator)
        if bias:
            norm.bias.normal_(0.0, 0.5, generator=generator)
    assert norm.weight.shape == ((3, 8) if per_head else (8,))
    x = (torch.randn(2, 3, 5, 8, generator=generator, dtype=torch.float64) * 3 + 1).requires_grad_()
    ours = norm(x)
    weight = norm.weight.detach().clone().requires_grad_()
    bias_copy = norm.bias.detach().clone().requires_grad_() if bias else None
    x_copy = x.detach().clone().requires_grad_()
    theirs = reference_qk_norm(x_copy, kind, weight, bias_copy, 1e-5)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)
    grad = torch.randn(ours.shape, generator=generator, dtype=torch.float64)
    ours.backward(grad)
    theirs.backward(grad)
    torch.testing.assert_close(x.grad, x_copy.grad, rtol=0, atol=1e-11)
    torch.testing.assert_close(norm.weight.grad, weight.grad, rtol=0, atol=1e-11)
    if bias:
        torch.testing.assert_close(norm.bias.grad, bias_copy.grad, rtol=0, atol=1e-11)


def test_head_norm_takes_bf16_statistics_in_fp32_and_reads_the_rows_it_is_given():
    from meshlm.models.norms import HeadNorm

    norm = HeadNorm("layernorm", 8, 1e-5, heads=4)
    with torch.no_grad():
        norm.weight.copy_(torch.arange(1.0, 5.0)[:, None].expand(4, 8))
    x = (torch.randn(2, 4, 3, 8) * 50 + 200).bfloat16()  # a large mean: bf16 sums would lose the spread
    expected = reference_qk_norm(x.float(), "layernorm", norm.weight.detach(), None, 1e-5)
    out = norm(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=2 ** -7, atol=1e-6)  # one rounding of the output
    norm.head_rows = slice(2, 4)  # tensor parallelism with replicated key heads: this rank's heads 2 and 3
    torch.testing.assert_close(norm(x[:, 2:].float()), expected[:, 2:], rtol=0, atol=1e-5)
