"""Linear layers whose three GEMMs run on quantized operands, and putting a recipe on a model.

``quantized_linear(x, weight, bias, recipe)`` is ``F.linear`` with every GEMM operand quantized
as ``recipe`` says (``meshlm/precision/recipes.py``), forward and backward:

    forward   y  = q_a(x) q_w(W)^T + b               (blocks along the input features)
    backward  dx = q_g(dY) q_w(W^T)^T                (blocks along the output features)
              dW = q_g(dY^T) q_a(X^T)^T              (blocks along the tokens; NVFP4: after the
                                                      random Hadamard transform of both)
              db = sum of dY over the tokens          (high precision)

The autograd function saves x and W in the run's dtype (not their quantized copies: each GEMM
wants its own layout and blocks) and quantizes again in backward.

``apply_recipe(model, recipe, num_blocks, high_precision_layers)`` turns the ``nn.Linear`` layers inside the
model's blocks into ``QuantizedLinear`` (same parameters, same state dict), except those of the
first and last ``high_precision_layers`` blocks and, when that is positive, of the MTP depths --
what the NVFP4 recipe keeps in bf16. The embedding, the output head, norms, the attention core,
the SSD scan, MoE routers and experts' grouped weights, and the optimizer stay in high precision
(the experts' grouped GEMMs are not quantized yet).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshlm.models.block import Block
from meshlm.precision.recipes import Recipe


class _QuantizedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inputs, weight, bias, recipe):
        ctx.save_for_backward(inputs, weight)
        ctx.recipe = recipe
        out = torch.matmul(recipe.quantize(inputs, "activation"), recipe.quantize(weight, "weight").t())
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, grad_out):
        inputs, weight = ctx.saved_tensors
        recipe = ctx.recipe
        grad_2d, inputs_2d = grad_out.reshape(-1, grad_out.shape[-1]), inputs.reshape(-1, inputs.shape[-1])
        grad_inputs = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:  # dgrad: contraction over the output features
            grad_inputs = torch.matmul(recipe.quantize(grad_out, "gradient"),
                                       recipe.quantize(weight.t(), "weight").t()).view_as(inputs)
        if ctx.needs_input_grad[1]:  # wgrad: contraction over the tokens
            grad_t, inputs_t = recipe.wgrad_operands(grad_2d, inputs_2d)
            grad_weight = torch.matmul(grad_t, inputs_t.t()).to(weight.dtype)
        if ctx.needs_input_grad[2]:  # False without a bias
            grad_bias = grad_2d.sum(0)
        return grad_inputs, grad_weight, grad_bias, None


def quantized_linear(inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     recipe: Recipe) -> torch.Tensor:
    """``F.linear(inputs, weight, bias)`` with the recipe's quantized GEMMs (module docstring);
    inputs [..., in], weight [out, in], bias [out] or None."""
    return _QuantizedLinear.apply(inputs, weight, bias, recipe)


class QuantizedLinear(nn.Linear):
    """An ``nn.Linear`` whose GEMMs run under ``recipe`` (set by ``apply_recipe``)."""

    recipe: Recipe | None = None

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.recipe is None:
            return F.linear(inputs, self.weight, self.bias)
        return quantized_linear(inputs, self.weight, self.bias, self.recipe)


def is_quantized_block(layer_index: int, num_blocks: int, high_precision_layers: int) -> bool:
    """Whether a recipe quantizes block ``layer_index`` of a model with ``num_blocks`` main blocks:
    not the first or last ``high_precision_layers``, nor (when that is positive) an MTP block
    (index >= num_blocks)."""
    keep = high_precision_layers
    if layer_index >= num_blocks:
        return keep == 0
    return keep <= layer_index < num_blocks - keep


def quantized_blocks(model: nn.Module, num_blocks: int, high_precision_layers: int) -> list[Block]:
    """The blocks of ``model`` (all of them, a pipeline stage's, MTP depths included) that
    ``is_quantized_block`` chooses."""
    return [module for module in model.modules()
            if isinstance(module, Block) and is_quantized_block(module.layer_index, num_blocks, high_precision_layers)]


def apply_recipe(model: nn.Module, recipe: Recipe, num_blocks: int, high_precision_layers: int = 0) -> int:
    """Quantize the ``nn.Linear`` layers of the chosen blocks in place (class swap, same parameters);
    returns how many layers now run under ``recipe``."""
    count = 0
    for block in quantized_blocks(model, num_blocks, high_precision_layers):
        for module in block.modules():
            if type(module) is nn.Linear:
                module.__class__ = QuantizedLinear
                module.recipe = recipe
                count += 1
    return count


__all__ = ["QuantizedLinear", "apply_recipe", "is_quantized_block", "quantized_blocks", "quantized_linear"]
