"""Linear layers whose three GEMMs run on quantized operands, and putting a recipe on a model.

A quantized linear computes ``F.linear`` with every GEMM operand quantized as its recipe says
(``meshlm/precision/recipes.py``), forward and backward:

    forward   y  = q_a(x) q_w(W)^T + b               (blocks along the input features)
    backward  dx = q_g(dY) q_w(W^T)^T                (blocks along the output features)
              dW = q_g(dY^T) q_a(X^T)^T              (blocks along the tokens; NVFP4: after the
                                                      random Hadamard transform of both)
              db = sum of dY over the tokens          (high precision)

The autograd function saves x and W in the run's dtype (not their quantized copies: each GEMM
wants its own layout and blocks) and quantizes again in backward.

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

``apply_recipe`` puts the recipe on the blocks' linear layers: an ``nn.Linear`` becomes a
``QuantizedLinear`` (class swap: same parameters, same state dict) and a tensor-parallel linear
gets the ``quantization`` attribute its forward reads -- except in the first and last
``high_precision_layers`` blocks and, when that is positive, in the MTP depths (what the NVFP4
recipe keeps in bf16). The embedding, the output head, norms, the attention core, the SSD scan,
MoE routers and the experts' grouped weights stay in high precision (the experts' grouped GEMMs
are not quantized yet).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from meshlm.errors import ConfigError
from meshlm.models.block import Block
from meshlm.precision.delayed_scaling import DelayedScaling
from meshlm.precision.formats.hashed_noise import noise_key
from meshlm.precision.fp8_gemm import hardware_fp8_supported, scaled_matmul
from meshlm.precision.recipes import Recipe
from meshlm.precision.formats.fp8 import scale_from_amax

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

    def linear(self, inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(inputs, weight, bias)`` with the recipe's quantized GEMMs."""
        return _QuantizedLinear.apply(inputs, weight, bias, self)

    def quantize(self, tensor: torch.Tensor, tensor_name: str, use: str, record: bool = False) -> torch.Tensor:
        """``tensor`` (all or a shard of the layer's ``tensor_name``, in the layout of GEMM operand
        ``use``) quantized and dequantized; ``record``: count its amax in the step's history."""
        tensor_amax, scale = self.tensor_scaling(tensor, tensor_name, record)
        role = ROLES[tensor_name]
        key = noise_key(self.recipe.seed, self.recipe.step, self.key, USES[use]) if role == "gradient" else None
        return self.recipe.quantize(tensor, role, tensor_amax=tensor_amax, scale=scale, noise_key=key)

    def codes(self, tensor: torch.Tensor, tensor_name: str, record: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(FP8 codes, scales) of ``tensor [rows, contraction]`` for the hardware GEMM; as ``quantize``."""
        tensor_amax, scale = self.tensor_scaling(tensor, tensor_name, record)
        return self.recipe.fp8_codes(tensor, ROLES[tensor_name], tensor_amax=tensor_amax, scale=scale)

    def gemm(self, a: torch.Tensor, a_name: str, a_use: str, b: torch.Tensor, b_name: str, b_use: str,
             out_dtype: torch.dtype, record_a: bool = False, record_b: bool = False) -> torch.Tensor:
        """``q(a) q(b)^T`` for ``a [M, K]``, ``b [N, K]`` (the contraction last in both), in ``out_dtype``:
        on the FP8 codes with the hardware GEMM, or on the dequantized operands; ``record_*``: count
        that operand's amax in the delayed-scaling history."""
        if self.hardware:
            return scaled_matmul(*self.codes(a.contiguous(), a_name, record_a),
                                 *self.codes(b.contiguous(), b_name, record_b), out_dtype=out_dtype)
        return torch.matmul(self.quantize(a, a_name, a_use, record_a),
                            self.quantize(b, b_name, b_use, record_b).t()).to(out_dtype)

    def tensor_scaling(self, tensor: torch.Tensor, tensor_name: str, record: bool) -> tuple:
        """(whole-tensor amax, reduced over the shards' groups; delayed scale, or None) for a
        per-tensor recipe; (None, None) for block scales. ``record``: note the amax in the history."""
        recipe, role, groups = self.recipe, ROLES[tensor_name], self.groups[tensor_name]
        scale = tensor_amax = None
        if recipe.per_tensor:
            amax = tensor.detach().float().abs().amax()
            if self.delayed is not None:
                if record:
                    self.delayed.record(tensor_name, amax)
                if not self.delayed.empty:
                    scale = scale_from_amax(self.delayed.window_amax(tensor_name), recipe.fp8_format_of(role))
            if scale is None:
                tensor_amax = amax
                for group in groups:
                    if group is not None and group.size > 1:
                        self.reduce_max(tensor_amax, group)
        return tensor_amax, scale


class _QuantizedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inputs, weight, bias, quantization):
        ctx.save_for_backward(inputs, weight)
        ctx.quantization = quantization
        training = any(ctx.needs_input_grad)  # evaluation does not move the delayed-scaling history
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
        return grad_inputs, grad_weight, grad_bias, None


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

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.quantization is None:
            return F.linear(inputs, self.weight, self.bias)
        return self.quantization.linear(inputs, self.weight, self.bias)


# --- putting a recipe on a model ---------------------------------------------------------------------

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


def _check_cut(recipe: Recipe, layer: str, what: str, sizes: list[int], fix: str) -> None:
    """ConfigError unless every shard size in ``sizes`` is a multiple of the recipe's block size."""
    block = recipe.block_size
    if block > 1 and any(size % block for size in sizes):
        raise ConfigError(f"precision.recipe={recipe.name} scales blocks of {block} elements, but this layout cuts "
                          f"{layer}'s {what} into shards of {sizes}, not multiples of {block}, so a block would "
                          f"straddle two ranks; {fix}, or use precision.recipe=fp8_tensorwise or fp8_delayed "
                          "(per-tensor scales fit any layout).")


def _groups_of(module: nn.Module, layer: str, recipe: Recipe, context) -> dict:
    """The groups each tensor of ``module`` is sharded over (module docstring), after checking its cuts."""
    tp = getattr(context, "tp_group", None) if context is not None else None
    cp = getattr(context, "cp_group", None) if context is not None else None
    tp_size = getattr(context, "tp_size", 1) if context is not None else 1
    fix = "use a smaller parallel.tp"
    layer = "block " + layer.replace(".", " ", 1) if layer[:1].isdigit() else layer  # "block 3 mixer.in_proj"
    kind = getattr(module, "tensor_parallel", None)  # parallel/tensor/layers.py's layers say how they are cut
    if kind == "column":
        sizes = [size // tp_size for size in module.partition_sizes]
        _check_cut(recipe, layer, "output features (per partition, per rank)", sizes, fix)
        return {"input": (cp,), "weight": (tp,), "grad_output": (tp, cp)}
    if kind == "row":
        _check_cut(recipe, layer, "input features (per rank)", [module.in_features], fix)
        return {"input": (tp, cp), "weight": (tp,), "grad_output": (cp,)}
    return {"input": (cp,), "weight": (), "grad_output": (cp,)}


def check_sequence_cut(recipe: Recipe, context, seq_len: int) -> None:
    """Under context parallelism a rank's tokens are two chunks of seq_len / (2 cp): the weight
    gradient's blocks along the tokens must not straddle chunks."""
    cp_size = getattr(context, "cp_size", 1) if context is not None else 1
    if cp_size > 1:
        _check_cut(recipe, "every linear layer", "tokens (context-parallel chunks of the sequence)",
                   [seq_len // (2 * cp_size)], f"use a train.seq_len that is a multiple of {2 * cp_size * recipe.block_size}")


def layer_key(name: str) -> int:
    """A stable 32-bit number for a layer's global name (the same in every layout and process)."""
    return zlib.crc32(name.encode())


def apply_recipe(model: nn.Module, recipe: Recipe, num_blocks: int, high_precision_layers: int = 0,
                 context=None, seq_len: int | None = None, reduce_max: Callable | None = None) -> int:
    """Put ``recipe`` on the linear layers of the chosen blocks in place (module docstring); returns
    how many layers now run under it. ``context``: the run's ``ParallelContext`` (None: one process);
    ``seq_len``: the training sequence length (checked against the CP chunks); ``reduce_max``: the
    collective for sharded amaxes (``LinearQuantization.reduce_max``)."""
    if seq_len is not None:
        check_sequence_cut(recipe, context, seq_len)
    count = 0
    for block in quantized_blocks(model, num_blocks, high_precision_layers):
        for name, module in block.named_modules():
            kind = getattr(module, "tensor_parallel", None)
            if kind == "replicated rows":
                raise ConfigError(f"precision.recipe={recipe.name} cannot quantize block {block.layer_index} {name} "
                                  f"exactly: with fewer "
                                  f"key/value heads than parallel.tp ranks its output gradient is summed across "
                                  "ranks after the GEMM; use parallel.tp <= model.num_kv_heads, or precision.recipe=none.")
            if type(module) is nn.Linear:
                module.__class__ = QuantizedLinear
            elif kind not in ("column", "row"):
                continue
            quantize_layer(module, recipe, f"{block.layer_index}.{name}", context, reduce_max)
            count += 1
    return count


def quantize_layer(module: nn.Module, recipe: Recipe, name: str, context=None, reduce_max: Callable | None = None) -> None:
    """Give one linear layer (``QuantizedLinear``, column- or row-parallel) its ``quantization``:
    ``name`` is its global name (keys its stochastic rounding), ``context`` the run's (None: one
    process), ``reduce_max`` the collective for sharded amaxes (needed where a group has > 1 rank)."""
    groups = _groups_of(module, name, recipe, context)
    if reduce_max is None and recipe.per_tensor and any(group is not None and group.size > 1
                                                        for members in groups.values() for group in members):
        raise ValueError(f"{name} is sharded over a group of several ranks: pass reduce_max (the run's all-reduce "
                         "with op='max', meshlm.parallel.collectives.all_reduce_) to reduce its amaxes.")
    delayed = DelayedScaling(recipe.amax_history, module.weight.device) if recipe.name == "fp8_delayed" else None
    module.quantization = LinearQuantization(recipe, layer_key(name), groups, delayed,
                                             hardware_gemm(recipe, module.weight.device, module.weight.dtype), reduce_max)


__all__ = ["LinearQuantization", "QuantizedLinear", "apply_recipe", "check_sequence_cut", "is_quantized_block",
           "layer_key", "quantize_layer", "quantized_blocks", "quantized_linear"]
