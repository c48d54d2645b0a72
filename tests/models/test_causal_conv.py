"""The causal depthwise conv + SiLU as shifted multiply-adds (meshlm/models/causal_conv.py) equals
the grouped ``F.conv1d`` with the window in front, values and gradients (window included)."""

import pytest
import torch
import torch.nn.functional as F

from meshlm.models.causal_conv import causal_conv_silu

BATCH, LENGTH, CHANNELS = 2, 11, 6


def conv1d_reference(inputs, weight, bias, window):
    """silu(F.conv1d) over [window; inputs] (zeros when window is None), channels last."""
    taps = weight.shape[-1]
    if window is None:
        window = inputs.new_zeros(inputs.shape[0], taps - 1, inputs.shape[2])
    extended = torch.cat((window, inputs), dim=1).transpose(1, 2)
    return F.silu(F.conv1d(extended, weight, bias, groups=inputs.shape[2])).transpose(1, 2)


@pytest.mark.parametrize("taps", [1, 2, 4])
@pytest.mark.parametrize("with_window,with_bias", [(False, True), (True, True), (True, False)])
def test_matches_conv1d_values_and_gradients(taps, with_window, with_bias):
    generator = torch.Generator().manual_seed(taps)
    def leaf(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).requires_grad_()
    inputs, weight = leaf(BATCH, LENGTH, CHANNELS), leaf(CHANNELS, 1, taps)
    bias = leaf(CHANNELS) if with_bias else None
    window = leaf(BATCH, taps - 1, CHANNELS) if with_window else None
    leaves = [tensor for tensor in (inputs, weight, bias, window) if tensor is not None]
    grad_out = torch.randn(BATCH, LENGTH, CHANNELS, generator=generator, dtype=torch.float64)
    results = []
    for conv in (causal_conv_silu, conv1d_reference):
        out = conv(inputs, weight, bias, window)
        results.append([out] + list(torch.autograd.grad((out * grad_out).sum(), leaves)))
    for actual, expected in zip(*results):
        torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)


def test_bf16_stays_bf16_and_close():
    generator = torch.Generator().manual_seed(0)
    inputs, weight, bias = (torch.randn(*shape, generator=generator) for shape in
                            ((BATCH, LENGTH, CHANNELS), (CHANNELS, 1, 4), (CHANNELS,)))
    out = causal_conv_silu(inputs.bfloat16(), weight.bfloat16(), bias.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), conv1d_reference(inputs, weight, bias, None), rtol=3e-2, atol=3e-2)
