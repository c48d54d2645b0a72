"""Putting a low-precision recipe on a model: which layers, sharded over which groups.

``apply_recipe`` walks the blocks a recipe quantizes -- all of them except the first and last
``precision.high_precision_layers`` and, when that is positive, the MTP depths (what the NVFP4
recipe keeps in bf16) -- and gives every linear layer a ``LinearQuantization``
(``quantized_linear.py``: an ``nn.Linear`` becomes a ``QuantizedLinear``, a class swap with the
same parameters and state dict; a tensor-parallel linear gets the ``quantization`` attribute its
forward reads) and the routed experts one ``GroupedQuantization`` per stacked weight
(``quantized_experts.py``). The embedding, the output head, norms, the attention core, the SSD
scan and the MoE routers stay in high precision.

For each layer it works out the groups over which each tensor is sharded (whose per-tensor
amaxes are reduced, see the two modules' docstrings) from how ``meshlm/parallel`` split the
layer -- the ``tensor_parallel`` attribute a parallel layer carries ("column", "row",
"replicated rows"; experts: "ffn" or "expert grid") -- and checks that block scales never
straddle two ranks, refusing the layout with the layer named otherwise.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

from torch import nn

from meshlm.errors import ConfigError
from meshlm.models.block import Block
from meshlm.models.lora import AdaptedLinear
from meshlm.models.moe.experts import GroupedExperts
from meshlm.precision.delayed_scaling import OPERANDS, DelayedScaling
from meshlm.precision.quantized_experts import WEIGHTS, GroupedQuantization
from meshlm.precision.quantized_linear import ROLES, LinearQuantization, QuantizedLinear, hardware_gemm
from meshlm.precision.recipes import Recipe


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


def check_block_cut(recipe: Recipe, layer: str, what: str, sizes: list[int], fix: str) -> None:
    """ConfigError unless every shard size in ``sizes`` is a multiple of the recipe's block size."""
    block = recipe.block_size
    if block > 1 and any(size % block for size in sizes):
        raise ConfigError(f"precision.recipe={recipe.name} scales blocks of {block} elements, but this layout cuts "
                          f"{layer}'s {what} into shards of {sizes}, not multiples of {block}, so a block would "
                          f"straddle two ranks; {fix}, or use precision.recipe=fp8_tensorwise or fp8_delayed "
                          "(per-tensor scales fit any layout).")


def linear_groups(module: nn.Module, layer: str, recipe: Recipe, context) -> dict:
    """The groups each tensor of ``module`` is sharded over (module docstring), after checking its cuts."""
    tp = getattr(context, "tp_group", None) if context is not None else None
    cp = getattr(context, "cp_group", None) if context is not None else None
    tp_size = getattr(context, "tp_size", 1) if context is not None else 1
    fix = "use a smaller parallel.tp"
    layer = "block " + layer.replace(".", " ", 1) if layer[:1].isdigit() else layer  # "block 3 mixer.in_proj"
    kind = getattr(module, "tensor_parallel", None)  # parallel/tensor/layers.py's layers say how they are cut
    if kind == "column":
        sizes = [size // tp_size for size in module.partition_sizes]
        check_block_cut(recipe, layer, "output features (per partition, per rank)", sizes, fix)
        return {"input": (cp,), "weight": (tp,), "grad_output": (tp, cp)}
    if kind == "row":
        check_block_cut(recipe, layer, "input features (per rank)", [module.in_features], fix)
        return {"input": (tp, cp), "weight": (tp,), "grad_output": (cp,)}
    return {"input": (cp,), "weight": (), "grad_output": (cp,)}


def check_sequence_cut(recipe: Recipe, context, seq_len: int) -> None:
    """Under context parallelism a rank's tokens are two chunks of seq_len / (2 cp): the weight
    gradient's blocks along the tokens must not straddle chunks."""
    cp_size = getattr(context, "cp_size", 1) if context is not None else 1
    if cp_size > 1:
        check_block_cut(recipe, "every linear layer", "tokens (context-parallel chunks of the sequence)",
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
                                  "exactly: it is replicated over the parallel.tp ranks (key/value projections "
                                  "with fewer KV heads than ranks; latent attention's down-projections), so its "
                                  "output gradient is summed across ranks after the GEMM; use parallel.tp <= "
                                  "model.num_kv_heads (for latent attention parallel.tp=1), or precision.recipe=none.")
            if isinstance(module, GroupedExperts):
                count += quantize_experts(module, recipe, f"{block.layer_index}.{name}", context, reduce_max)
                continue
            if type(module) in (nn.Linear, AdaptedLinear):  # a LoRA adapter stays in high precision
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
    groups = linear_groups(module, name, recipe, context)
    if reduce_max is None and recipe.per_tensor and any(group is not None and group.size > 1
                                                        for members in groups.values() for group in members):
        raise ValueError(f"{name} is sharded over a group of several ranks: pass reduce_max (the run's all-reduce "
                         "with op='max', meshlm.parallel.collectives.all_reduce_) to reduce its amaxes.")
    delayed = (DelayedScaling(recipe.amax_history, module.weight.device, formats=delayed_formats(recipe))
               if recipe.name == "fp8_delayed" else None)
    module.quantization = LinearQuantization(recipe, layer_key(name), groups, delayed,
                                             hardware_gemm(recipe, module.weight.device, module.weight.dtype), reduce_max)


def delayed_formats(recipe: Recipe) -> tuple:
    """The FP8 format of each operand a ``DelayedScaling`` tracks (``OPERANDS``), as ``recipe`` assigns them."""
    return tuple(recipe.fp8_format_of(ROLES[operand]) for operand in OPERANDS)


def expert_groups(experts: GroupedExperts, name: str, recipe: Recipe, layer: str, context) -> dict:
    """The groups each tensor of the stacked weight ``name`` is sharded over, after checking the
    layout quantizes like one process (module docstring)."""
    kind = getattr(experts, "tensor_parallel", None)  # set by meshlm/parallel when it splits the experts
    if kind == "expert grid":
        shared = {"parallel.tp": context.tp_size, "parallel.cp": context.cp_size, "parallel.etp": context.etp_size}
        if any(size > 1 for size in shared.values()):
            sizes = ", ".join(f"{key}={size}" for key, size in shared.items() if size > 1)
            raise ConfigError(f"precision.recipe={recipe.name} quantizes each expert's tokens of a micro-batch as one "
                              f"operand, but with {sizes} an expert-parallel rank receives a micro-batch's tokens "
                              f"from several ranks ({layer}); fold parallel.ep over data-parallel ranks only "
                              "(parallel.tp=1, parallel.cp=1, parallel.etp=1), or use precision.recipe=none.")
        return {"input": (), "weight": (), "grad_output": ()}
    if kind != "ffn" or context is None or context.tp_size == 1:
        return {"input": (), "weight": (), "grad_output": ()}
    tp = context.tp_group
    shard = experts.up_weight.shape[1] if name != "down_weight" else experts.down_weight.shape[2]
    check_block_cut(recipe, layer, "FFN width (per rank)", [shard], "use a smaller parallel.tp")
    if name == "down_weight":
        return {"input": (tp,), "weight": (tp,), "grad_output": ()}
    return {"input": (), "weight": (tp,), "grad_output": (tp,)}


def expert_numbering(experts: GroupedExperts, context) -> tuple[int, int]:
    """(the global number of this rank's first expert, the layer's experts over all EP ranks):
    E/ep of them per EP rank on the expert grid, all of them elsewhere."""
    local = experts.up_weight.shape[0]
    if getattr(experts, "tensor_parallel", None) != "expert grid":
        return 0, local
    return context.ep_rank * local, context.ep_size * local


def quantize_experts(experts: GroupedExperts, recipe: Recipe, name: str, context=None,
                     reduce_max: Callable | None = None) -> int:
    """Give ``experts`` (global name ``name``) a ``GroupedQuantization`` per stacked weight; returns
    how many weights now run under the recipe."""
    first, num_experts = expert_numbering(experts, context)
    quantizations = {}
    for weight_name in WEIGHTS:
        weight = getattr(experts, weight_name)
        if weight is None:
            continue
        layer = f"{name}.{weight_name}"
        groups = expert_groups(experts, weight_name, recipe, layer, context)
        if reduce_max is None and any(group.size > 1 for members in groups.values() for group in members):
            raise ValueError(f"{layer} is sharded over a group of several ranks: pass reduce_max.")
        keys = [layer_key(f"{layer}.{first + index}") for index in range(weight.shape[0])]
        delayed = (DelayedScaling(recipe.amax_history, weight.device, num_experts, formats=delayed_formats(recipe))
                   if recipe.name == "fp8_delayed" else None)
        quantizations[weight_name] = GroupedQuantization(recipe, keys, groups, reduce_max, delayed, first,
                                                         hardware_gemm(recipe, weight.device, weight.dtype))
    experts.quantizations = quantizations
    return len(quantizations)


__all__ = ["apply_recipe", "check_block_cut", "check_sequence_cut", "expert_groups", "expert_numbering",
           "is_quantized_block", "layer_key", "linear_groups", "quantize_experts", "quantize_layer", "quantized_blocks"]
