"""The routed experts' grouped GEMMs under a low-precision recipe.

The experts hold three stacked weights ``[E, out, in]`` and run each as a *grouped* linear: the
rows of expert e (a contiguous segment of the permuted tokens, ``meshlm/models/moe/experts.py``)
times ``W[e]^T``. Under a recipe every expert is its own linear layer, and all three of its GEMMs
are quantized as ``quantized_linear.py`` quantizes a dense layer's:

    forward   y_e  = q_a(X_e) q_w(W_e)^T
    backward  dX_e = q_g(dY_e) q_w(W_e^T)^T
              dW_e = q_g(dY_e^T) q_a(X_e^T)^T        (NVFP4: after the random Hadamard transform)

with each expert's own per-tensor scales (fp8 scales, NVFP4's fp32 tensor scale): the amax of
its tokens and of its weight, as Transformer Engine's grouped linear keeps one scale per GEMM of
the group. Forward and data gradient dequantize the operands and run the ordinary grouped GEMM
on them (one kernel for all experts, ``grouped_linear``); the weight gradient is a matmul per
segment.

**Segments.** The single process quantizes each expert's tokens of one micro-batch as one
operand. Under expert parallelism an expert's rank receives its rows from every rank of its EP
group, grouped (expert, source): when the EP group is folded over data-parallel ranks only,
each source is a whole micro-batch, so each (expert, source) segment is exactly one of the
single process's operands -- the rows, their order and their blocks -- and quantizing per
segment gives the single-process numbers (the weight gradient sums the segments' products, as
the single process accumulates its micro-batches). When an EP group also spans tensor- or
context-parallel ranks (which share a micro-batch), or expert tensor parallelism gathers the
tokens of several ranks, an expert's operand is split over sources in another order, and block
scales along the tokens would differ from one process's: that layout is refused.

**Sharded weights.** With tensor parallelism and no expert grid the experts are split on their
FFN width over TP (``meshlm/parallel/tensor/moe.py``): gate/up column-parallel, down row-parallel,
every rank holding the whole micro-batch's rows. The per-expert amaxes of the sharded tensors
are then reduced (max) over TP, one all-reduce of an [E] vector per tensor:

    tensor        gate / up (column)     down (row)
    input         --                     TP
    weight        TP                     TP
    output grad   TP                     --

and every FFN shard must hold whole blocks (checked at start-up).

Limits: the experts' GEMMs always run emulated (a hardware grouped FP8 GEMM is not used yet), and
under ``fp8_delayed`` the experts scale from the current amax (no history per expert).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from meshlm.models.moe.experts import grouped_linear
from meshlm.precision.formats.fp8 import abs_max
from meshlm.precision.formats.hashed_noise import noise_key
from meshlm.precision.quantized_linear import ROLES, USES
from meshlm.precision.recipes import Recipe

WEIGHTS = ("gate_weight", "up_weight", "down_weight")
"""The experts' stacked weights; gate/up are column-parallel under TP, down row-parallel."""


@dataclass(eq=False)
class GroupedQuantization:
    """How one stacked expert weight's grouped GEMMs are quantized (module docstring)."""

    recipe: Recipe
    keys: list[int]
    """Per local expert: the 32-bit hash of its global name (its part of the stochastic-rounding key)."""
    groups: dict
    """{'input' | 'weight' | 'grad_output': tuple of Groups the per-expert amaxes are reduced over}."""
    reduce_max: Callable | None = None
    """``reduce_max(tensor, group)``: the run's all-reduce (max), as ``LinearQuantization.reduce_max``."""

    def linear(self, tokens: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor,
               rows_per_source: torch.Tensor | None = None) -> torch.Tensor:
        """The grouped linear of ``experts.py`` (rows of expert e times ``weight[e]^T``) with quantized
        GEMMs; ``rows_per_source`` [local experts, sources]: each expert's rows from each source."""
        counts = tokens_per_expert[:, None] if rows_per_source is None else rows_per_source
        segment_rows = counts.flatten().tolist()
        segment_experts = torch.arange(counts.shape[0]).repeat_interleave(counts.shape[1]).tolist()
        return _QuantizedGroupedLinear.apply(tokens, weight, tokens_per_expert, segment_rows, segment_experts, self)

    def amaxes(self, pieces: list[torch.Tensor], tensor_name: str) -> list[torch.Tensor | None]:
        """Per piece, its amax reduced over the tensor's groups (None everywhere for block scales)."""
        if not self.recipe.per_tensor or not pieces:
            return [None] * len(pieces)
        amax = torch.stack([abs_max(piece) if piece.numel() else
                            piece.new_zeros((), dtype=torch.float32) for piece in pieces])
        for group in self.groups[tensor_name]:
            if group is not None and group.size > 1:
                self.reduce_max(amax, group)
        return list(amax.unbind())

    def quantize(self, pieces: list[torch.Tensor], tensor_name: str, use: str, experts: list[int],
                 amaxes: list[torch.Tensor | None]) -> list[torch.Tensor]:
        """Each piece (an operand of expert ``experts[i]``) quantized and dequantized."""
        role, recipe = ROLES[tensor_name], self.recipe
        return [piece if not piece.numel() else
                recipe.quantize(piece, role, tensor_amax=amax,
                                noise_key=noise_key(recipe.seed, recipe.step, self.keys[expert], USES[use])
                                if role == "gradient" and recipe.rounds_stochastically else None)
                for piece, expert, amax in zip(pieces, experts, amaxes)]


class _QuantizedGroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, weight, tokens_per_expert, segment_rows, segment_experts, quantization):
        ctx.save_for_backward(tokens, weight, tokens_per_expert)
        ctx.segment_rows, ctx.segment_experts, ctx.quantization = segment_rows, segment_experts, quantization
        experts = list(range(weight.shape[0]))
        weights = list(weight.unbind(0))
        ctx.weight_amaxes = quantization.amaxes(weights, "weight")
        segments = list(tokens.split(segment_rows))
        inputs = quantization.quantize(segments, "input", "fprop_input", segment_experts,
                                       quantization.amaxes(segments, "input"))
        quantized_weight = torch.stack(quantization.quantize(weights, "weight", "fprop_weight", experts,
                                                             ctx.weight_amaxes))
        return grouped_linear(torch.cat(inputs), quantized_weight, tokens_per_expert)

    @staticmethod
    def backward(ctx, grad_out):
        tokens, weight, tokens_per_expert = ctx.saved_tensors
        quantization, experts = ctx.quantization, ctx.segment_experts
        grad_segments = list(grad_out.split(ctx.segment_rows))
        grad_tokens = grad_weight = None
        if ctx.needs_input_grad[0]:  # dgrad: contraction over the output features
            grads = quantization.quantize(grad_segments, "grad_output", "dgrad_grad", experts,
                                          quantization.amaxes(grad_segments, "grad_output"))
            transposed = quantization.quantize([w.t() for w in weight.unbind(0)], "weight", "dgrad_weight",
                                               list(range(weight.shape[0])), ctx.weight_amaxes)
            grad_tokens = grouped_linear(torch.cat(grads), torch.stack(transposed), tokens_per_expert)
        if ctx.needs_input_grad[1]:  # wgrad: per segment, contraction over its tokens
            grad_weight = weight_gradient(quantization, grad_segments, list(tokens.split(ctx.segment_rows)),
                                          experts, weight)
        return grad_tokens, grad_weight, None, None, None, None


def weight_gradient(quantization: GroupedQuantization, grad_segments: list[torch.Tensor],
                    input_segments: list[torch.Tensor], experts: list[int], weight: torch.Tensor) -> torch.Tensor:
    """dW_e = sum over e's segments of q(dY_s^T) q(X_s^T)^T, accumulated in fp32."""
    recipe = quantization.recipe
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    kept = [index for index, segment in enumerate(grad_segments) if segment.shape[0]]
    layouts = [recipe.wgrad_layout(grad_segments[index], input_segments[index]) for index in kept]
    owners = [experts[index] for index in kept]
    grads_t = quantization.quantize([grad_t for grad_t, _ in layouts], "grad_output", "wgrad_grad", owners,
                                    quantization.amaxes([grad_t for grad_t, _ in layouts], "grad_output"))
    inputs_t = quantization.quantize([inputs_t for _, inputs_t in layouts], "input", "wgrad_input", owners,
                                     quantization.amaxes([inputs_t for _, inputs_t in layouts], "input"))
    for expert, grad_t, inputs_t in zip(owners, grads_t, inputs_t):
        grad_weight[expert] += (grad_t @ inputs_t.t()).float()
    return grad_weight.to(weight.dtype)


__all__ = ["GroupedQuantization", "WEIGHTS", "weight_gradient"]
