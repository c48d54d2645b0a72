"""Linear layers whose three GEMMs run on quantized operands, and putting a recipe on a model.

A quantized linear computes ``F.linear`` with every GEMM operand quantized as its recipe says
(``meshlm/precision/recipes.py``), forward and backward:

    forward   y  = q_a(x) q_w(W)^T + b               (blocks along the input features)
    backward  dx = q_g(dY) q_w(W^T)^T                (blocks along the output features)
              dW = q_g(dY^T) q_a(X^T)^T              (blocks along the tokens; NVFP4: after the
                                                      random Hadamard transform of both)
              db = sum of dY over the tokens          (high precision)

The autograd function saves x and W in the run's dtype (not their quantized copies: each GEMM
wants its own layout and blocks) and quantizes again in backward -- except per-tensor FP8 on the
hardware GEMM, where a transposed operand's codes are the transposed codes, so the codes are
kept and transposed (``quantized_projections._SavedCodesProjections``, here with one layer).

**One process or many, the same numbers.** Each layer carries a ``LinearQuantization``: its
recipe, a key (a hash of the layer's global name, for stochastic rounding), the groups over
which each of its three tensors is sharded, and its delayed-scaling history (``fp8_delayed``).
A per-tensor scale is taken from the amax of the *whole* tensor, reduced (max) over those
groups:

    tensor        plain / replicated   column-parallel (TP)   row-parallel (TP)
    input x       CP                   CP                     TP, CP
    weight W      --                   TP                     TP
    output grad   CP                   TP, CP                 CP

(CP shards every tensor that has tokens; under sequence parallelism the tokens inside a TP
region are whole again.) Block scales need each block inside one shard: ``apply_recipe`` checks
that every TP-sharded dimension (each partition of a fused projection) and every CP chunk of the
sequence is cut at a multiple of the recipe's block size, and refuses the layout otherwise,
naming the layer. Stochastic rounding is hashed from the values (``formats/hashed_noise.py``).
Data and pipeline parallelism quantize each micro-batch's tensors as one process does.

**Hardware FP8 GEMMs.** Where ``precision.fp8_gemm`` allows and the device runs them
(``hardware_gemm``), the FP8 recipes hand the FP8 codes and scales to ``torch._scaled_mm``
(``fp8_gemm.py``) instead of multiplying dequantized tensors: the same quantization, the GEMM
accumulated in fp32 on the codes.

``model_recipe.apply_recipe`` puts a recipe on a model's layers (an ``nn.Linear`` becomes a
``QuantizedLinear``: class swap, same parameters, same state dict); the experts' grouped GEMMs
are ``quantized_experts.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from meshlm.errors import ConfigError
from meshlm.models.lora import with_adapter
from meshlm.precision.delayed_scaling import DelayedScaling
from meshlm.precision.formats.hashed_noise import noise_key
from meshlm.precision.fp8_gemm import hardware_fp8_supported, scaled_matmul
from meshlm.precision.quantized_projections import project_quantized, shares_input_codes
from meshlm.precision.recipes import Recipe
from meshlm.precision.formats.fp8 import abs_max

ROLES = {"input": "activation", "weight": "weight", "grad_output": "gradient"}
"""The format role (recipes.py) of each tensor of a linear layer."""
USES = {"fprop_input": 0, "fprop_weight": 1, "dgrad_grad": 2, "dgrad_weight": 3, "wgrad_grad": 4, "wgrad_input": 5}
"""Each GEMM operand, numbered for the stochastic-rounding key."""


@dataclass(eq=False)
class LinearQuantization:
    """How one linear layer's GEMM operands are quantized (see the module docstring)."""

    recipe: Recipe
    key: int
    """32-bit hash of the layer's global name: its part of the stochastic-rounding key."""
    groups: dict
    """{'input' | 'weight' | 'grad_output': tuple of Groups (None entries allowed) the tensor is sharded over}."""
    delayed: DelayedScaling | None = None
    """fp8_delayed: this layer's amax history."""
    hardware: bool = False
    """Multiply FP8 codes with the hardware GEMM (``fp8_gemm.py``) instead of dequantized tensors."""
    reduce_max: Callable | None = None
    """``reduce_max(tensor, group)``: all-reduce (max) in place over a group (the run's collective,
    ``meshlm.parallel.collectives.all_reduce_`` with op='max'; passed in: precision sits beside
    parallelism, not above it). Needed where a group has more than one rank."""
    keep_weight_codes: bool = False
    """Keep the weight's FP8 codes from the first GEMM that casts them until ``keeping_weight_codes``
    ends (the micro-batches of one training step, between which the weight does not change)."""
    kept_weight_codes: tuple | None = None
    """(codes, scale, transposed codes) kept under ``keep_weight_codes``; None: none kept."""

    def linear(self, inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(inputs, weight, bias)`` with the recipe's quantized GEMMs."""
        training = records_amax(inputs, weight)
        if self.hardware and self.recipe.per_tensor:  # fp8_tensorwise, fp8_delayed on FP8 hardware
            needs_transpose = torch.is_grad_enabled() and inputs.requires_grad  # for the data gradient
            codes = self.weight_codes(weight, training, needs_transpose)
            return project_quantized(inputs, [weight], [bias], [self], training, [codes])[0]  # one layer
        return _QuantizedLinear.apply(inputs, weight, bias, self, training)

    def weight_codes(self, weight: torch.Tensor, training: bool, needs_transpose: bool) -> tuple:
        """(codes, scale, transposed codes or None) of ``weight`` for the per-tensor hardware path:
        the kept ones where ``keeping_weight_codes`` holds them, else cast now (and kept when it is
        on). The transposed codes (for the data gradient's GEMM) are made where ``needs_transpose``.
        The weight's amax is recorded (``training``) when its codes are cast: once a step when
        they are kept, which leaves the step's max -- all a delayed history keeps -- the same."""
        def cast() -> tuple:
            codes, scale = self.codes(weight.detach().contiguous(), "weight", training)
            return codes, scale, codes.t().contiguous() if needs_transpose else None

        return kept_or_cast(self, needs_transpose, cast)

    def linear_together(self, inputs: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None],
                        quantizations: list["LinearQuantization"]) -> tuple[torch.Tensor, ...] | None:
        """Several layers' ``linear`` of one input (``quantizations``: theirs, this one first), the
        input cast to FP8 once where they share its codes (``quantized_projections.py``); None
        where they do not, and each layer runs its own forward."""
        if not shares_input_codes(quantizations):
            return None
        training = records_amax(inputs, *weights)
        needs_transpose = torch.is_grad_enabled() and inputs.requires_grad
        weight_codes = [quantization.weight_codes(weight, training, needs_transpose)
                        for quantization, weight in zip(quantizations, weights)]
        return project_quantized(inputs, weights, biases, quantizations, training, weight_codes)

    def quantize(self, tensor: torch.Tensor, tensor_name: str, use: str, record: bool = False) -> torch.Tensor:
        """``tensor`` (all or a shard of the layer's ``tensor_name``, in the layout of GEMM operand
        ``use``) quantized and dequantized; ``record``: count its amax in the step's history."""
        tensor_amax, scale = self.tensor_scaling(tensor, tensor_name, record)
        role = ROLES[tensor_name]
        key = (noise_key(self.recipe.seed, self.recipe.step, self.key, USES[use])
               if role == "gradient" and self.recipe.rounds_stochastically else None)
        return self.recipe.quantize(tensor, role, tensor_amax=tensor_amax, scale=scale, noise_key=key)

    def codes(self, tensor: torch.Tensor, tensor_name: str, record: bool = False,
              sharing: tuple = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """(FP8 codes, scales) of ``tensor [rows, contraction]`` for the hardware GEMM; as ``quantize``.
        ``sharing``: other layers' quantizations that use these codes too (``quantized_projections.py``)."""
        tensor_amax, scale = self.tensor_scaling(tensor, tensor_name, record, sharing)
        return self.recipe.fp8_codes(tensor, ROLES[tensor_name], tensor_amax=tensor_amax, scale=scale)

    def gemm(self, a: torch.Tensor, a_name: str, a_use: str, b: torch.Tensor, b_name: str, b_use: str,
             out_dtype: torch.dtype, record_a: bool = False, record_b: bool = False) -> torch.Tensor:
        """``q(a) q(b)^T`` for ``a [M, K]``, ``b [N, K]`` (the contraction last in both), in ``out_dtype``:
        on the FP8 codes with the hardware GEMM, or on the dequantized operands; ``record_*``: count
        that operand's amax in the delayed-scaling history."""
        if self.hardware:
            return scaled_matmul(*self.codes(a.contiguous(), a_name, record_a),
                                 *self.codes(b.contiguous(), b_name, record_b), out_dtype=out_dtype,
                                 verified=True,  # hardware_gemm asked when the layer was set up
                                 fast_accumulation=self.recipe.accumulates_fast(a_use.split("_")[0]))
        return torch.matmul(self.quantize(a, a_name, a_use, record_a),
                            self.quantize(b, b_name, b_use, record_b).t()).to(out_dtype)

    def tensor_scaling(self, tensor: torch.Tensor, tensor_name: str, record: bool, sharing: tuple = ()) -> tuple:
        """(whole-tensor amax, reduced over the shards' groups; delayed scale, or None) for a
        per-tensor recipe; (None, None) for block scales. ``record``: note the amax in the history,
        and in the histories of the layers ``sharing`` this tensor's quantization."""
        scale = tensor_amax = None
        if not self.recipe.per_tensor:
            return tensor_amax, scale
        delayed = self.delayed
        if delayed is not None and not delayed.empty:
            scale = delayed.scale(tensor_name)  # from the window, in the tensor's format
        if scale is not None and not record:
            return tensor_amax, scale  # evaluation under delayed scaling: no amax needed
        amax = abs_max(tensor)
        if record:
            for layer in (self, *sharing):
                if layer.delayed is not None:
                    layer.delayed.record(tensor_name, amax)
        if scale is None:
            tensor_amax = amax
            for group in self.groups[tensor_name]:
                if group is not None and group.size > 1:
                    self.reduce_max(tensor_amax, group)
        return tensor_amax, scale


def kept_or_cast(quantization, needs_transpose: bool, cast: Callable[[], tuple]) -> tuple:
    """The weight codes ``quantization`` keeps (``keeping_weight_codes``) where they serve -- a
    tuple whose last entry, the transposed codes, is there where ``needs_transpose`` -- else
    ``cast()``'s, made without autograd (the weight's gradient comes from the GEMMs' autograd
    function) and kept while ``quantization.keep_weight_codes`` is on. For ``LinearQuantization``
    and ``quantized_experts.GroupedQuantization`` alike."""
    kept = quantization.kept_weight_codes
    if kept is not None and (kept[-1] is not None or not needs_transpose):
        return kept
    with torch.no_grad():
        codes = cast()
    if quantization.keep_weight_codes:
        quantization.kept_weight_codes = codes
    return codes


def records_amax(*tensors: torch.Tensor) -> bool:
    """Whether a quantized GEMM on ``tensors`` belongs to a training step, whose amaxes the
    delayed-scaling history records: autograd records it (evaluation and generation, under
    ``torch.no_grad``, do not move the history). Asked outside the autograd functions, inside
    whose forward grad mode is always off and ``needs_input_grad`` still names the parameters."""
    return torch.is_grad_enabled() and any(tensor.requires_grad for tensor in tensors)


class _QuantizedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inputs, weight, bias, quantization, training):
        ctx.save_for_backward(inputs, weight)
        ctx.quantization = quantization
        out = quantization.gemm(inputs.reshape(-1, inputs.shape[-1]), "input", "fprop_input", weight, "weight",
                                "fprop_weight", inputs.dtype, training, training)
        out = out.view(*inputs.shape[:-1], weight.shape[0])
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, grad_out):
        inputs, weight = ctx.saved_tensors
        quantization = ctx.quantization
        grad_2d, inputs_2d = grad_out.reshape(-1, grad_out.shape[-1]), inputs.reshape(-1, inputs.shape[-1])
        grad_inputs = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:  # dgrad: contraction over the output features
            grad_inputs = quantization.gemm(grad_2d, "grad_output", "dgrad_grad", weight.t(), "weight", "dgrad_weight",
                                            grad_out.dtype, record_a=True).view_as(inputs)
        if ctx.needs_input_grad[1]:  # wgrad: contraction over the tokens
            grad_t, inputs_t = quantization.recipe.wgrad_layout(grad_2d, inputs_2d)
            grad_weight = quantization.gemm(grad_t, "grad_output", "wgrad_grad", inputs_t, "input", "wgrad_input",
                                            weight.dtype, record_a=True)
        if ctx.needs_input_grad[2]:  # False without a bias
            grad_bias = grad_2d.sum(0)
        return grad_inputs, grad_weight, grad_bias, None, None


@contextlib.contextmanager
def keeping_weight_codes(model: nn.Module):
    """Inside: each per-tensor FP8 layer on the hardware GEMM, and each stacked expert weight on it,
    casts its weight once and keeps the codes (and their transpose) for every further GEMM -- the
    trainer wraps one step's micro-batches in it, between which the optimizer does not touch the
    weights (Transformer Engine's ``is_first_microbatch``). At the end the codes are dropped, so an
    evaluation, a generation or the next step casts the weights as they are then. The numbers
    are those of casting at every micro-batch; the casts are one a step instead of one a
    micro-batch (weight-sized reads and writes: 3 bytes a parameter each time)."""
    layers = [module.quantization for module in model.modules()
              if isinstance(getattr(module, "quantization", None), LinearQuantization)
              and module.quantization.hardware and module.quantization.recipe.per_tensor]
    layers += [grouped for module in model.modules()  # the experts' stacked weights (quantized_experts.py)
               for grouped in (getattr(module, "quantizations", None) or {}).values() if grouped.hardware]
    for quantization in layers:
        quantization.keep_weight_codes, quantization.kept_weight_codes = True, None
    try:
        yield
    finally:
        for quantization in layers:
            quantization.keep_weight_codes, quantization.kept_weight_codes = False, None


def hardware_gemm(recipe: Recipe, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``recipe``'s GEMMs run on FP8 codes (``precision.fp8_gemm``): 'auto' where a CUDA
    device runs every scale layout and format pair the recipe needs, 'hardware' wherever this torch
    does (the CPU included: a check of the path, not a speed-up), 'emulated' never."""
    if recipe.fp8_gemm == "emulated":
        return False
    if recipe.name not in ("fp8_tensorwise", "fp8_delayed", "fp8_blockwise"):
        if recipe.fp8_gemm == "hardware":
            raise ConfigError(f"precision.fp8_gemm=hardware runs the FP8 recipes' GEMMs on FP8 codes, but "
                              f"precision.recipe={recipe.name} is emulated only; use precision.fp8_gemm=auto.")
        return False
    activation, weight, gradient = (recipe.fp8_format_of(role).dtype for role in ("activation", "weight", "gradient"))
    main, wgrad = recipe.hardware_scalings()
    needs = [(main, activation, weight), (main, gradient, weight), (wgrad, gradient, activation)]
    supported = all(hardware_fp8_supported(device, scaling, a, b, dtype) for scaling, a, b in needs)
    if recipe.fp8_gemm == "hardware" and not supported:
        raise ConfigError(f"precision.fp8_gemm=hardware, but torch {torch.__version__} on {device} cannot run the "
                          f"FP8 GEMMs precision.recipe={recipe.name} needs ({main} and {wgrad} scales); use "
                          "precision.fp8_gemm=auto (emulated where the hardware GEMM is missing).")
    return supported and (recipe.fp8_gemm == "hardware" or device.type == "cuda")


def quantized_linear(inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     recipe: Recipe, key: int = 0) -> torch.Tensor:
    """``F.linear(inputs, weight, bias)`` with ``recipe``'s quantized GEMMs, as one unsharded layer
    (no groups, no history); inputs [..., in], weight [out, in], bias [out] or None."""
    return LinearQuantization(recipe, key, {name: () for name in ROLES},
                              hardware=hardware_gemm(recipe, weight.device, weight.dtype)).linear(inputs, weight, bias)


class QuantizedLinear(nn.Linear):
    """An ``nn.Linear`` whose GEMMs run under ``quantization`` (set by ``apply_recipe``)."""

    quantization: LinearQuantization | None = None
    forward_is_linear = True
    """Its forward is the (quantized) linear map of its input and nothing else, so the layers
    that read one input may run together (``meshlm/models/fused_linear.project_together``)."""

    def forward(self, inputs: torch.Tensor, coordinates=None) -> torch.Tensor:
        if self.quantization is None:
            out = F.linear(inputs, self.weight, self.bias)
        else:
            out = self.quantization.linear(inputs, self.weight, self.bias)
        # a LoRA adapter stays in high precision (``coordinates``: the tokens', for its dropout)
        return with_adapter(self, inputs, out, coordinates=coordinates)


__all__ = ["LinearQuantization", "QuantizedLinear", "ROLES", "USES", "hardware_gemm", "kept_or_cast",
           "keeping_weight_codes", "quantized_linear", "records_amax"]
