"""Mamba-2's short causal convolution with its SiLU, as K shifted multiply-adds.

Before the scan, x, B and C pass through a depthwise causal convolution of K taps (K = 4 in
Mamba-2 and Nemotron-H) and a SiLU (Dao & Gu 2024, §7):

    out[t, ch] = silu(bias[ch] + sum_k weight[ch, k] * in[t - (K-1) + k, ch])

with ``in`` before the first token taken from a *window* of the K-1 previous inputs (zeros at
the start of a sequence; the previous chunk's tail under context parallelism; the cached tail
while generating). As a grouped ``F.conv1d`` this is the slowest part of the layer on CPU: the
oneDNN depthwise backward takes several times the time of the whole SSD scan. With K this small
it is cheaper as what it is, K multiply-adds of shifted views of a channels-last tensor, which
also needs no transposes (the projection already gives [b, t, channels]).

``causal_conv_silu`` is one autograd function: it saves only its input and window (views the
layer keeps anyway) and recomputes the pre-activation in backward, where

    g = grad_out * silu'(pre),   silu'(v) = sigmoid(v) (1 + v (1 - sigmoid(v)))
    d in[t - (K-1) + k] += weight[k] g[t],   d weight[k] = sum_t g[t] in[t - (K-1) + k],   d bias = sum_t g[t]

and the gradient of the window goes back to wherever the window came from. The weight and bias
gradients are sums over every position of the batch: they are accumulated in fp64 and rounded
once, so that they do not depend on how the positions are split (context parallelism sums the
ranks' partial sums) beyond that final rounding.

**Packed documents** (``document_positions``, each token's position inside its document): the
window restarts at every document's first token, as if each document were its own sequence. Tap
k reads the input j = K-1-k tokens back, which lies in the same document iff the token's
position is >= j; the other taps are masked out (0/1 factors in forward and backward alike).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _extended(inputs: torch.Tensor, window: torch.Tensor | None, taps: int) -> torch.Tensor:
    """[b, K-1 + t, ch]: the window (zeros if None) followed by the inputs."""
    if window is None:
        return F.pad(inputs, (0, 0, taps - 1, 0))
    return torch.cat((window.to(inputs.dtype), inputs), dim=1)


def _extended_again(inputs: torch.Tensor, window: torch.Tensor | None, taps: int) -> torch.Tensor:
    """``_extended`` for the backward, built by concatenating zeros rather than by the forward's
    padding: the same values from a different operation, so that ``torch.compile`` does not take
    the two for one expression and keep the forward's padded copy ([b, K-1 + t, ch], written only
    to be saved) until the backward; the backward then reads the inputs, which the layer keeps anyway."""
    if window is None:
        window = inputs.new_zeros(inputs.shape[0], taps - 1, inputs.shape[2])
    return torch.cat((window.to(inputs.dtype), inputs), dim=1)


def _same_document(k: int, taps: int, document_positions: torch.Tensor | None, dtype) -> torch.Tensor | None:
    """[b, t, 1]: 1 where tap k reads the reading token's own document, 0 where an earlier one
    (module docstring); None when every tap does (no documents, or the token itself)."""
    if document_positions is None or k == taps - 1:
        return None
    return (document_positions >= taps - 1 - k)[..., None].to(dtype)


def _tap(extended: torch.Tensor, k: int, length: int, document_positions: torch.Tensor | None) -> torch.Tensor:
    """The inputs tap k reads, [b, t, ch]: extended[:, k : k + t], masked by document."""
    read = extended[:, k:k + length]
    keep = _same_document(k, extended.shape[1] - length + 1, document_positions, read.dtype)
    return read if keep is None else read * keep


def _pre_activation(extended: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    length: int, document_positions: torch.Tensor | None = None) -> torch.Tensor:
    """bias + sum_k weight[:, k] * extended[:, k : k + t] -> [b, t, ch] (taps masked by documents)."""
    taps = weight.shape[-1]
    pre = extended[:, taps - 1:] * weight[:, taps - 1]
    for k in range(taps - 1):
        pre.addcmul_(_tap(extended, k, length, document_positions), weight[:, k])
    if bias is not None:
        pre += bias
    return pre


def _conv_silu(inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               window: torch.Tensor | None, document_positions: torch.Tensor | None = None) -> torch.Tensor:
    """The forward computation: silu of the pre-activation over [window; inputs]."""
    extended = _extended(inputs, window, weight.shape[-1])
    return F.silu(_pre_activation(extended, weight, bias, inputs.shape[1], document_positions))


class _CausalConvSiLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inputs, weight, bias, window, document_positions):
        ctx.save_for_backward(inputs, weight, bias, window, document_positions)
        return _conv_silu(inputs, weight, bias, window, document_positions)

    @staticmethod
    def backward(ctx, grad_out):
        inputs, weight, bias, window, document_positions = ctx.saved_tensors
        taps, length = weight.shape[-1], inputs.shape[1]
        extended = _extended_again(inputs, window, taps)
        pre = _pre_activation(extended, weight, bias, length, document_positions)
        sigmoid = torch.sigmoid(pre)
        grad_pre = grad_out * sigmoid * (1 + pre * (1 - sigmoid))
        del pre, sigmoid
        grad_extended = torch.zeros_like(extended)
        grad_weight = torch.empty_like(weight)
        for k in range(taps):
            keep = _same_document(k, taps, document_positions, grad_pre.dtype)
            masked_grad = grad_pre if keep is None else grad_pre * keep
            grad_extended[:, k:k + length].addcmul_(masked_grad, weight[:, k])
            grad_weight[:, k] = (masked_grad * extended[:, k:k + length]).sum((0, 1), dtype=torch.float64)
        grad_bias = grad_pre.sum((0, 1), dtype=torch.float64).to(bias.dtype) if bias is not None else None
        grad_window = grad_extended[:, :taps - 1] if window is not None and ctx.needs_input_grad[3] else None
        return grad_extended[:, taps - 1:], grad_weight, grad_bias, grad_window, None


def causal_conv_silu(inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     window: torch.Tensor | None = None,
                     document_positions: torch.Tensor | None = None) -> torch.Tensor:
    """silu(depthwise causal conv) of inputs [b, t, ch] (channels last), continuing from ``window``
    [b, K-1, ch] (None: zeros, the start of a sequence). ``weight`` is [ch, K] or Conv1d's
    [ch, 1, K]; ``bias`` [ch] or None. Returns [b, t, ch], equal to the grouped ``F.conv1d``.
    ``document_positions`` [b, t]: each token's position in its packed document; the window
    restarts at each document's first token (module docstring)."""
    weight = weight.reshape(weight.shape[0], -1)
    if not torch.is_grad_enabled():  # generation: no backward, no autograd function needed
        return _conv_silu(inputs, weight, bias, window, document_positions)
    return _CausalConvSiLU.apply(inputs, weight, bias, window, document_positions)


__all__ = ["causal_conv_silu"]
