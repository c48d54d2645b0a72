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

**Delayed scaling** (``fp8_delayed``): each stacked weight keeps one history per expert,
``[N, E, 3]`` over the global experts (``delayed_scaling.py``); a piece of expert e scales from
e's window, or from its current amax while that window is still empty.

**Hardware FP8 GEMMs.** Where ``precision.fp8_gemm`` and the device allow it
(``quantized_linear.hardware_gemm``), the FP8 recipes multiply codes instead of dequantized
tensors: one ``scaled_matmul`` (``fp8_gemm.py``) per segment for the forward and data gradient,
and per segment for the weight gradient -- the same operands, scales and blocks as the
emulation, accumulated in fp32. (A grouped FP8 kernel would launch once for all experts; that
is a speed-up for later, behind the same interface.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from meshlm.models.moe.experts import grouped_linear
from meshlm.precision.delayed_scaling import DelayedScaling
from meshlm.precision.formats.fp8 import abs_max
from meshlm.precision.formats.hashed_noise import noise_key
from meshlm.precision.fp8_gemm import aligned_entries, scaled_matmul
from meshlm.precision.quantized_linear import ROLES, USES, kept_or_cast, records_amax
from meshlm.precision.recipes import Recipe

WEIGHTS = ("gate_weight", "up_weight", "down_weight")
"""The experts' stacked weights; gate/up are column-parallel under TP, down row-parallel."""


Scaling = tuple
"""How a per-tensor recipe scales one piece: (its amax reduced over its groups, or None; its
delayed scale, or None); (None, None) under block scales."""


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
    delayed: DelayedScaling | None = None
    """fp8_delayed: the histories of every expert of the layer, by global expert number."""
    first_expert: int = 0
    """The global number of this rank's first local expert (expert parallelism)."""
    hardware: bool = False
    """Multiply FP8 codes with the hardware GEMM (``fp8_gemm.py``) instead of dequantized tensors."""
    keep_weight_codes: bool = False
    """As ``LinearQuantization.keep_weight_codes``: keep each expert's weight codes over a step's
    micro-batches (``quantized_linear.keeping_weight_codes``; the hardware path)."""
    kept_weight_codes: tuple | None = None
    """(scalings, codes, transposed codes) kept under ``keep_weight_codes``; None: none kept."""

    def linear(self, tokens: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor,
               rows_per_source: torch.Tensor | None = None) -> torch.Tensor:
        """The grouped linear of ``experts.py`` (rows of expert e times ``weight[e]^T``) with quantized
        GEMMs; ``rows_per_source`` [local experts, sources]: each expert's rows from each source."""
        counts = tokens_per_expert[:, None] if rows_per_source is None else rows_per_source
        segment_rows = counts.flatten().tolist()
        segment_experts = torch.arange(counts.shape[0]).repeat_interleave(counts.shape[1]).tolist()
        training = records_amax(tokens, weight)
        weight_codes = (self.weight_codes(weight, training, torch.is_grad_enabled() and tokens.requires_grad)
                        if self.hardware else None)
        return _QuantizedGroupedLinear.apply(tokens, weight, tokens_per_expert, segment_rows, segment_experts, self,
                                             training, weight_codes)

    def weight_codes(self, weight: torch.Tensor, training: bool, needs_transpose: bool) -> tuple:
        """(scalings, codes, transposed codes or None) of each expert's weight ``weight[e]`` for the
        hardware GEMMs -- the forward's ``[N, K]`` and, where ``needs_transpose``, the data
        gradient's ``[K, N]`` -- as ``LinearQuantization.weight_codes``: the kept ones where
        ``keeping_weight_codes`` holds them, else cast now (and kept when it is on)."""
        def cast() -> tuple:
            weights = list(weight.detach().unbind(0))
            scalings = self.scalings(weights, "weight", list(range(len(weights))), record=training)
            codes = self.codes(weights, "weight", scalings)
            transposed = self.codes([piece.t() for piece in weights], "weight", scalings) if needs_transpose else None
            return scalings, codes, transposed

        return kept_or_cast(self, needs_transpose, cast)

    def scalings(self, pieces: list[torch.Tensor], tensor_name: str, experts: list[int],
                 record: bool = False) -> list[Scaling]:
        """Per piece (an operand of local expert ``experts[i]``), how a per-tensor recipe scales it:
        from its expert's delayed-scaling window where that holds an amax, else from the piece's
        amax reduced over the tensor's groups. ``record``: note the pieces' amaxes in their
        experts' histories (training steps)."""
        if not self.recipe.per_tensor or not pieces:
            return [(None, None)] * len(pieces)
        amax = torch.stack([abs_max(piece) if piece.numel() else
                            piece.new_zeros((), dtype=torch.float32) for piece in pieces])
        owners = [self.first_expert + expert for expert in experts]
        scales: list[torch.Tensor | None] = [None] * len(pieces)
        if self.delayed is not None:
            if record:
                self.delayed.record(tensor_name, amax, torch.tensor(owners, device=amax.device))
            if self.delayed.filled is not None:
                window = self.delayed.scale(tensor_name)  # [E]: each expert's, from its window
                if self.hardware:  # each expert's scale goes to scaled_mm as it is: 16-byte aligned
                    window = aligned_entries(window)
                scales = [window[owner] if self.delayed.is_filled(tensor_name, owner) else None for owner in owners]
        if any(scale is None for scale in scales):  # every rank of a group holds the same experts and windows
            for group in self.groups[tensor_name]:
                if group is not None and group.size > 1:
                    self.reduce_max(amax, group)
        if self.hardware:  # each expert's amax becomes its scaled_mm scale: 16-byte aligned
            amax = aligned_entries(amax)
        return [(amax[index] if scale is None else None, scale) for index, scale in enumerate(scales)]

    def quantize(self, pieces: list[torch.Tensor], tensor_name: str, use: str, experts: list[int],
                 scalings: list[Scaling]) -> list[torch.Tensor]:
        """Each piece (an operand of expert ``experts[i]``) quantized and dequantized."""
        role, recipe = ROLES[tensor_name], self.recipe
        return [piece if not piece.numel() else
                recipe.quantize(piece, role, tensor_amax=amax, scale=scale,
                                noise_key=noise_key(recipe.seed, recipe.step, self.keys[expert], USES[use])
                                if role == "gradient" and recipe.rounds_stochastically else None)
                for piece, expert, (amax, scale) in zip(pieces, experts, scalings)]

    def codes(self, pieces: list[torch.Tensor], tensor_name: str,
              scalings: list[Scaling]) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Each piece's (FP8 codes, scales) for the hardware GEMM (None for an empty piece)."""
        role = ROLES[tensor_name]
        return [None if not piece.numel() else
                self.recipe.fp8_codes(piece.contiguous(), role, tensor_amax=amax, scale=scale)
                for piece, (amax, scale) in zip(pieces, scalings)]


def hardware_products(a_codes: list, b_codes: list, shapes: list[tuple[int, int]], like: torch.Tensor,
                      out_dtype: torch.dtype, fast_accumulation: bool = False) -> list[torch.Tensor]:
    """``a_i b_i^T`` on the FP8 codes of each pair (``scaled_matmul``); an empty pair gives zeros of
    ``shapes[i]``."""
    return [like.new_zeros(shape, dtype=out_dtype) if a is None or b is None else
            scaled_matmul(*a, *b, out_dtype=out_dtype, verified=True,  # hardware_gemm asked at set-up
                          fast_accumulation=fast_accumulation)
            for a, b, shape in zip(a_codes, b_codes, shapes)]


class _QuantizedGroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, weight, tokens_per_expert, segment_rows, segment_experts, quantization, training,
                weight_codes):
        ctx.save_for_backward(tokens, weight, tokens_per_expert)
        ctx.segment_rows, ctx.segment_experts, ctx.quantization = segment_rows, segment_experts, quantization
        segments = list(tokens.split(segment_rows))
        if quantization.hardware:  # weight_codes: GroupedQuantization.weight_codes's (scalings, codes, transposed)
            ctx.weight_scalings, codes, ctx.transposed_weight_codes = weight_codes
            input_scalings = quantization.scalings(segments, "input", segment_experts, record=training)
            return torch.cat(hardware_products(quantization.codes(segments, "input", input_scalings),
                                               [codes[expert] for expert in segment_experts],
                                               [(rows, weight.shape[1]) for rows in segment_rows], tokens,
                                               tokens.dtype, quantization.recipe.accumulates_fast("fprop")))
        experts = list(range(weight.shape[0]))
        weights = list(weight.unbind(0))
        ctx.weight_scalings = quantization.scalings(weights, "weight", experts, record=training)
        input_scalings = quantization.scalings(segments, "input", segment_experts, record=training)
        inputs = quantization.quantize(segments, "input", "fprop_input", segment_experts, input_scalings)
        quantized_weight = torch.stack(quantization.quantize(weights, "weight", "fprop_weight", experts,
                                                             ctx.weight_scalings))
        return grouped_linear(torch.cat(inputs), quantized_weight, tokens_per_expert)

    @staticmethod
    def backward(ctx, grad_out):
        tokens, weight, tokens_per_expert = ctx.saved_tensors
        quantization, experts = ctx.quantization, ctx.segment_experts
        grad_segments = list(grad_out.split(ctx.segment_rows))
        grad_tokens = grad_weight = None
        if ctx.needs_input_grad[0]:  # dgrad: contraction over the output features
            grad_scalings = quantization.scalings(grad_segments, "grad_output", experts, record=True)
            transposed = [w.t() for w in weight.unbind(0)]
            if quantization.hardware:
                weight_codes = ctx.transposed_weight_codes  # made with the forward's (needs_transpose)
                grad_tokens = torch.cat(hardware_products(
                    quantization.codes(grad_segments, "grad_output", grad_scalings),
                    [weight_codes[expert] for expert in experts],
                    [(rows, weight.shape[2]) for rows in ctx.segment_rows], grad_out, grad_out.dtype,
                    quantization.recipe.accumulates_fast("dgrad")))
            else:
                grads = quantization.quantize(grad_segments, "grad_output", "dgrad_grad", experts, grad_scalings)
                transposed = quantization.quantize(transposed, "weight", "dgrad_weight",
                                                   list(range(weight.shape[0])), ctx.weight_scalings)
                grad_tokens = grouped_linear(torch.cat(grads), torch.stack(transposed), tokens_per_expert)
        if ctx.needs_input_grad[1]:  # wgrad: per segment, contraction over its tokens
            grad_weight = weight_gradient(quantization, grad_segments, list(tokens.split(ctx.segment_rows)),
                                          experts, weight)
        return grad_tokens, grad_weight, None, None, None, None, None, None


def weight_gradient(quantization: GroupedQuantization, grad_segments: list[torch.Tensor],
                    input_segments: list[torch.Tensor], experts: list[int], weight: torch.Tensor) -> torch.Tensor:
    """dW_e = sum over e's segments of q(dY_s^T) q(X_s^T)^T, accumulated in fp32."""
    recipe = quantization.recipe
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    kept = [index for index, segment in enumerate(grad_segments) if segment.shape[0]]
    layouts = [recipe.wgrad_layout(grad_segments[index], input_segments[index]) for index in kept]
    owners = [experts[index] for index in kept]
    grads_t, inputs_t = [grad_t for grad_t, _ in layouts], [inputs_t for _, inputs_t in layouts]
    grad_scalings = quantization.scalings(grads_t, "grad_output", owners, record=True)
    input_scalings = quantization.scalings(inputs_t, "input", owners)
    if quantization.hardware:
        products = hardware_products(quantization.codes(grads_t, "grad_output", grad_scalings),
                                     quantization.codes(inputs_t, "input", input_scalings),
                                     [tuple(weight.shape[1:])] * len(owners), weight, weight.dtype,
                                     quantization.recipe.accumulates_fast("wgrad"))
    else:
        grads_t = quantization.quantize(grads_t, "grad_output", "wgrad_grad", owners, grad_scalings)
        inputs_t = quantization.quantize(inputs_t, "input", "wgrad_input", owners, input_scalings)
        products = [grad_t @ input_t.t() for grad_t, input_t in zip(grads_t, inputs_t)]
    for expert, product in zip(owners, products):
        grad_weight[expert] += product.float()
    return grad_weight.to(weight.dtype)


__all__ = ["GroupedQuantization", "WEIGHTS", "weight_gradient"]
