"""Quantized linear layers that read one input -- attention's q, k and v projections, a gated
MLP's gate and up projections -- with that input cast to FP8 once for all of them.

In bf16 such layers run as one GEMM over their concatenated weights
(``meshlm/models/fused_linear.py``). Under a per-tensor FP8 recipe on the hardware GEMM
(``fp8_tensorwise``, ``fp8_delayed``: ``_SavedCodesProjections``, with one layer) each layer keeps its
own weight scale and its own output-gradient scale, as the recipe and every layout's exactness
require, so the GEMMs stay apart -- but the input's scale is the same for all of them: its amax
is the amax of one tensor, reduced over the same groups (current scaling), or read from
histories that have recorded the same amaxes since the first step (delayed scaling: every layer
records the one input's amax). Its codes are then the same bytes for every layer, and so are
the transposed codes the weight gradients read. This path casts them once:

    forward    X -> (codes, scale) once;  y_i = q(X) q(W_i)^T       (one FP8 GEMM per layer)
    backward   dX = sum_i q(dY_i) q(W_i^T)^T                         (each dY_i with its own scale)
               dW_i = q(dY_i^T) q(X^T)^T                             (X^T's codes kept once)

where separate layers read X for its amax and cast it, and transpose its codes, once per layer
(three times for q, k, v) and each keep a copy of X^T's codes for backward. The numbers are the
separate layers': the same codes and scales, the same GEMMs; only the order in which the data
gradient's parts are added can differ from autograd's.

``LinearQuantization.linear_together`` (``quantized_linear.py``) is the entry point, which
``meshlm/models/fused_linear.project_together`` calls for q, k, v and gate, up. Which layers
qualify is ``shares_input_codes``: the same recipe (one ``Recipe`` is shared by a
model's layers), per-tensor and on the hardware GEMM, the input sharded over the same groups,
and all or none with a delayed-scaling history. Other recipes (block scales, the emulated path,
NVFP4) quantize per layer as before.
"""

from __future__ import annotations

import torch

from meshlm.precision.fp8_gemm import scaled_matmul


def shares_input_codes(quantizations: list) -> bool:
    """Whether layers under ``quantizations`` (their ``LinearQuantization``s, ``quantized_linear.py``)
    that read one input cast it to the same FP8 codes (module docstring), so that
    ``project_quantized`` may cast it once."""
    first = quantizations[0]
    return (len(quantizations) > 1
            and all(each.hardware and each.recipe.per_tensor for each in quantizations)
            and all(each.recipe is first.recipe for each in quantizations)
            and all(tuple(each.groups["input"]) == tuple(first.groups["input"]) for each in quantizations)
            and len({each.delayed is None for each in quantizations}) == 1)


def project_quantized(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None],
                      quantizations: list, training: bool, weight_codes: list[tuple]) -> tuple[torch.Tensor, ...]:
    """``F.linear(x, W_i, b_i)`` under each layer's ``quantizations[i]``, ``x`` cast once (the
    layers must satisfy ``shares_input_codes``; all with a bias or none). ``training``: the
    amaxes enter the delayed-scaling histories (``quantized_linear.records_amax``);
    ``weight_codes``: each weight's (codes, scale, transposed codes or None), as
    ``LinearQuantization.weight_codes`` gives them."""
    has_bias = biases[0] is not None
    codes, scales, transposed = zip(*weight_codes)
    return _SavedCodesProjections.apply(x, tuple(quantizations), has_bias, training, *weights,
                                        *(biases if has_bias else ()), *codes, *scales, *transposed)


class _SavedCodesProjections(torch.autograd.Function):
    """The hardware GEMMs of a per-tensor FP8 recipe for one linear layer or several reading one
    input, each operand quantized once per step.

    With one scale per tensor a transposed operand has the same amax, so the same scale, so its
    codes are the transposed codes: q(X^T) = q(X)^T, q(W^T) = q(W)^T, q(dY^T) = q(dY)^T, bit for
    bit (fp8_delayed's scale comes from a history that moves only after the step). So X, W and dY
    are each read for their amax and cast once, where the general path
    (``quantized_linear._QuantizedLinear``) reads each bf16 operand again for every GEMM it enters.

    The FP8 GEMM takes both operands with the contraction dim innermost, so the backward GEMMs
    need transposed copies: W^T for dgrad, dY^T and X^T for wgrad. Each is made where its codes
    are cast -- X^T in forward, W^T with W's codes (``LinearQuantization.weight_codes``, kept over
    a step's micro-batches where ``keeping_weight_codes`` says so), dY^T beside dY in backward --
    and the forward saves only the transposed codes (1 byte an element, half of what
    ``_QuantizedLinear`` keeps in bf16). Eagerly that is the same copy at another time; in a
    compiled block the cast and the transposed copy read the same values in one kernel, so the
    copy no longer reads the codes back (Transformer Engine's fused cast-transpose does the same).

    X's codes, scale and transposed codes are made once for all the layers; each output
    gradient's are its layer's."""

    @staticmethod
    def forward(ctx, x, quantizations, has_bias, training, *tensors):
        count = len(quantizations)
        weights = tensors[:count]
        biases = tensors[count:2 * count] if has_bias else (None,) * count
        codes = tensors[(2 if has_bias else 1) * count:]  # each weight's codes, then scales, then transposed codes
        first, others = quantizations[0], quantizations[1:]
        x_2d = x.reshape(-1, x.shape[-1]).contiguous()
        x_codes, x_scale = first.codes(x_2d, "input", training, sharing=others)
        outputs, saved = [], []
        for index, (quantization, weight, bias) in enumerate(zip(quantizations, weights, biases)):
            weight_codes, weight_scale, weight_codes_t = codes[index], codes[count + index], codes[2 * count + index]
            out = scaled_matmul(x_codes, x_scale, weight_codes, weight_scale, out_dtype=x.dtype, verified=True,
                                fast_accumulation=quantization.recipe.accumulates_fast("fprop"))
            out = out.view(*x.shape[:-1], weight.shape[0])
            outputs.append(out + bias if bias is not None else out)
            saved += [weight_codes_t if ctx.needs_input_grad[0] else None, weight_scale]
        wants_weight_grads = any(ctx.needs_input_grad[4:4 + count])
        x_codes_t = x_codes.t().contiguous() if wants_weight_grads else None  # wgrad reads X^T [K, T]
        ctx.save_for_backward(x_codes_t, x_scale, *saved)
        ctx.quantizations, ctx.input_shape, ctx.has_bias = quantizations, x.shape, has_bias
        ctx.weight_dtypes = [weight.dtype for weight in weights]
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grad_outputs):
        x_codes_t, x_scale, *saved = ctx.saved_tensors
        count = len(ctx.quantizations)
        grad_x, grad_weights, grad_biases = None, [None] * count, [None] * count
        for index, (quantization, grad_out) in enumerate(zip(ctx.quantizations, grad_outputs)):
            weight_codes_t, weight_scale = saved[2 * index], saved[2 * index + 1]
            recipe = quantization.recipe
            grad_2d = grad_out.reshape(-1, grad_out.shape[-1]).contiguous()
            grad_codes, grad_scale = quantization.codes(grad_2d, "grad_output", record=True)
            if ctx.needs_input_grad[0]:  # dgrad: dY_i [T, N_i] by W_i^T [K, N_i], summed over the layers
                part = scaled_matmul(grad_codes, grad_scale, weight_codes_t, weight_scale, out_dtype=grad_out.dtype,
                                     verified=True, fast_accumulation=recipe.accumulates_fast("dgrad"))
                grad_x = part if grad_x is None else grad_x + part
            if ctx.needs_input_grad[4 + index]:  # wgrad: dY_i^T [N_i, T] by X^T [K, T]
                grad_weights[index] = scaled_matmul(grad_codes.t().contiguous(), grad_scale, x_codes_t, x_scale,
                                                    out_dtype=ctx.weight_dtypes[index], verified=True,
                                                    fast_accumulation=recipe.accumulates_fast("wgrad"))
            if ctx.has_bias and ctx.needs_input_grad[4 + count + index]:
                grad_biases[index] = grad_2d.sum(0)
        if grad_x is not None:
            grad_x = grad_x.view(ctx.input_shape)
        return (grad_x, None, None, None, *grad_weights, *(grad_biases if ctx.has_bias else ()), *[None] * (3 * count))


__all__ = ["project_quantized", "shares_input_codes"]
