"""Several linear layers that read one input, run as one GEMM: attention's q, k and v projections,
a gated MLP's gate and up projections (Megatron-LM's ``linear_qkv`` and ``linear_fc1``).

Each layer keeps its own parameter -- the names, shapes and checkpoints of Hugging Face's Llama
and of every layout -- and ``project_together`` concatenates the weights along the output
dimension for one ``F.linear``, whose output it splits back into views. Both passes then run one
larger GEMM instead of several:

- forward, [tokens x hidden] by [hidden x (q + k + v)]: the key and value projections are narrow
  (4 KV heads of 128: 512 columns at the 1B dense shape of ``bench.gpu_throughput``), too narrow
  to keep a GPU's tensor cores busy on their own;
- backward, the input's gradient is summed by the GEMMs themselves, each layer's adding the first's
  result into its own (``addmm``), where separate layers give one result each and autograd adds
  them, one more pass over [tokens x hidden] per extra layer; each output's gradient arrives on
  its own, so no concatenation of them is made (``_FusedLinear``).

The concatenated weight is a copy made each forward and again in backward (the weights' bytes,
small beside the activations: 12.6 MB for q, k, v at the 1B shape against 134 MB of input at 8 x
4096 tokens); it is not kept between the two (``_FusedLinear`` saves the input and the layers'
own weights), so fusing adds no memory.
A layer with a LoRA adapter (``lora.py``) runs its frozen weight in the shared GEMM; its adapter's
detour is added to its slice of the output after.
Layers that do something of their own in their forward run separately, as they are: a layer with
hooks, a column-parallel layer that gathers its own input, or any other subclass. Quantized
layers (``meshlm/precision``) keep their own weight and gradient scales, so their GEMMs stay
apart; under a per-tensor FP8 recipe on the hardware GEMM they share the input's FP8 cast
(``meshlm/precision/quantized_projections.py``), under other recipes each runs its own forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshlm.models.dropout import TokenCoordinates
from meshlm.models.lora import adapted, with_adapter


def runs_fused(layer: nn.Module) -> bool:
    """Whether ``layer``'s forward is exactly ``F.linear(x, layer.weight, layer.bias)``: a plain
    ``nn.Linear`` (or a ``QuantizedLinear`` whose ``quantization`` is None), or a column-parallel
    linear whose caller gathered the input (``gather_input`` False), with no quantization and no
    hooks."""
    return reads_input_as_given(layer) and getattr(layer, "quantization", None) is None


def reads_input_as_given(layer: nn.Module) -> bool:
    """Whether ``layer``'s forward is its (possibly quantized) linear map of ``x`` and nothing else:
    an ``nn.Linear``, a class that declares ``forward_is_linear`` (a recipe's ``QuantizedLinear``),
    or a column-parallel linear whose caller gathered the input; either without hooks."""
    if layer._forward_hooks or layer._forward_pre_hooks:
        return False
    if type(layer) is nn.Linear or vars(type(layer)).get("forward_is_linear", False):
        return True
    return getattr(layer, "tensor_parallel", None) == "column" and not getattr(layer, "gather_input", True)


def project_together(x: torch.Tensor, layers: tuple[nn.Module, ...],
                     coordinates: TokenCoordinates | None = None) -> tuple[torch.Tensor, ...]:
    """Each of ``layers`` applied to ``x``: one GEMM over their concatenated weights when every
    layer ``runs_fused`` (same dtype, all with a bias or none); under a per-tensor FP8 recipe on
    the hardware GEMM, one cast of ``x`` for all of them (``meshlm/precision/quantized_projections.py``);
    else each layer's own forward. ``coordinates``: x's tokens', for the adapters' dropout."""
    weights = [layer.weight for layer in layers]
    biases = [layer.bias for layer in layers]
    alike = (len(layers) > 1 and all(reads_input_as_given(layer) for layer in layers)
             and len({(weight.dtype, weight.device, weight.shape[1]) for weight in weights}) == 1
             and len({bias is None for bias in biases}) == 1)
    quantizations = [getattr(layer, "quantization", None) for layer in layers]
    if alike and all(quantization is not None for quantization in quantizations):
        together = quantizations[0].linear_together(x, weights, biases, quantizations)
        if together is not None:
            return with_adapters(layers, x, together, coordinates)
    if not (alike and all(runs_fused(layer) for layer in layers)):
        return tuple(adapted(layer, x, coordinates) for layer in layers)
    has_bias = biases[0] is not None
    if not torch.is_grad_enabled():  # evaluation and generation: nothing to save, no autograd function
        outputs = F.linear(x, torch.cat(weights), torch.cat(biases) if has_bias else None).split(
            [weight.shape[0] for weight in weights], dim=-1)
    else:
        outputs = _FusedLinear.apply(x, has_bias, *weights, *(biases if has_bias else ()))
    return with_adapters(layers, x, outputs, coordinates)


def with_adapters(layers: tuple[nn.Module, ...], x: torch.Tensor, outputs,
                  coordinates: TokenCoordinates | None = None) -> tuple[torch.Tensor, ...]:
    """Each layer's output from the shared GEMM plus its LoRA adapter's detour, where it has one (``lora.py``)."""
    return tuple(with_adapter(layer, x, out, coordinates=coordinates) for layer, out in zip(layers, outputs))


class _FusedLinear(torch.autograd.Function):
    """(y_1, ..., y_n) = x [W_1; ...; W_n]^T (+ [b_1; ...; b_n]) split into each layer's output, saving x
    and the separate weights rather than their concatenation (which autograd would keep for the
    input's gradient). The outputs' gradients come back one per layer: dx = sum_i dy_i W_i (one GEMM
    each, each adding the sum so far: ``addmm``), dW_i = dy_i^T x, db_i = sum dy_i. Taking them apart, rather than as
    the gradient of one concatenated output, spares backward the concatenation autograd would make
    of them -- which a compiler fuses into the kernel producing them (the SwiGLU or RoPE backward),
    there writing each half while reading every input of both."""

    @staticmethod
    def forward(ctx, x, has_bias, *parameters):
        count = len(parameters) // 2 if has_bias else len(parameters)
        weights, biases = parameters[:count], parameters[count:]
        ctx.save_for_backward(x, *weights)
        ctx.has_bias = has_bias
        out = F.linear(x, torch.cat(weights), torch.cat(biases) if has_bias else None)
        return tuple(out.split([weight.shape[0] for weight in weights], dim=-1))

    @staticmethod
    def backward(ctx, *grad_outputs):
        x, *weights = ctx.saved_tensors
        grads = [torch.zeros(*x.shape[:-1], weight.shape[0], dtype=x.dtype, device=x.device) if grad is None
                 else grad for grad, weight in zip(grad_outputs, weights)]  # an output left unused
        flat_x = x.reshape(-1, x.shape[-1])
        flat_grads = [grad.reshape(-1, grad.shape[-1]) for grad in grads]
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = flat_grads[0].mm(weights[0])
            for grad, weight in zip(flat_grads[1:], weights[1:]):
                grad_x = torch.addmm(grad_x, grad, weight)  # summed in the GEMM: no separate addition pass
            grad_x = grad_x.view(x.shape)
        grad_weights = [grad.t().mm(flat_x) if needed else None
                        for grad, needed in zip(flat_grads, ctx.needs_input_grad[2:2 + len(weights)])]
        grad_biases = [grad.sum(0) for grad in flat_grads] if ctx.has_bias else []
        return (grad_x, None, *grad_weights, *grad_biases)


__all__ = ["project_together", "reads_input_as_given", "runs_fused"]
