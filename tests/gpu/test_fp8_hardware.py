"""The FP8 recipes on the hardware FP8 GEMM (``torch._scaled_mm``) against their emulation, on the GPU.

Under ``precision.fp8_gemm=auto`` a Hopper GPU multiplies the FP8 codes of every quantized GEMM
(``meshlm/precision/fp8_gemm.py``): the dense layers' (``quantized_linear.py``) and the experts'
(``quantized_experts.py``, one product per expert segment). The CPU suite checks both against the
emulation with the CPU's per-tensor ``_scaled_mm``; this tier checks them where they are meant to
run, in bf16, for ``fp8_tensorwise``, ``fp8_delayed`` (after one step, so that its scales come
from the history) and ``fp8_blockwise`` (1x128 tiles, 128x128 weight blocks, which only the CUDA
GEMM takes). The emulation multiplies the same quantized values, dequantized to bf16; the hardware
GEMM multiplies the codes and applies the scales in fp32, so the two differ by about one bf16
rounding of the operands: every output and gradient must agree within 2e-2 of its largest value,
and the hardware result must differ from the unquantized GEMM (it did quantize).

A recipe whose scales this GPU's torch cannot run is skipped with ``unsupported_reason``'s words.
In a CPU dry run the per-tensor recipes run on the CPU's ``_scaled_mm`` and fp8_blockwise skips.
"""

from __future__ import annotations

import pytest
import torch

from meshlm.errors import ConfigError
from meshlm.precision.delayed_scaling import DelayedScaling, begin_step, finish_step
from meshlm.precision.model_recipe import delayed_formats
from meshlm.precision.quantized_experts import GroupedQuantization
from meshlm.precision.quantized_linear import LinearQuantization, hardware_gemm
from meshlm.precision.recipes import Recipe

RECIPES = ["fp8_tensorwise", "fp8_delayed", "fp8_blockwise"]
NO_GROUPS = {"input": (), "weight": (), "grad_output": ()}
TOLERANCE = 2e-2
ROWS = [40, 0, 24, 64]
"""Tokens per expert: an expert without tokens, segments that are not multiples of 16."""


def seeded(*shape, device, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=torch.bfloat16)


def recipe_on(name: str, device: torch.device) -> Recipe:
    """The hardware recipe, or a skip naming why this device cannot run its GEMMs."""
    recipe = Recipe(name, fp8_gemm="hardware")
    try:
        hardware_gemm(recipe, device, torch.bfloat16)
    except ConfigError as error:
        pytest.skip(str(error))
    return recipe


class Holder(torch.nn.Module):
    """What ``begin_step`` / ``finish_step`` walk: modules with ``quantization`` or ``quantizations``."""

    def __init__(self, dense: LinearQuantization, experts: GroupedQuantization):
        super().__init__()
        self.layer, self.experts = torch.nn.Module(), torch.nn.Module()
        self.layer.quantization, self.experts.quantizations = dense, {"up_weight": experts}


def quantizations(recipe: Recipe, hardware: bool, device: torch.device) -> Holder:
    delayed = recipe.name == "fp8_delayed"
    formats = delayed_formats(recipe)
    dense = LinearQuantization(recipe, 7, NO_GROUPS, DelayedScaling(4, device, formats=formats) if delayed else None,
                               hardware)
    experts = GroupedQuantization(recipe, [1, 2, 3, 4], NO_GROUPS,
                                  delayed=(DelayedScaling(4, device, num_experts=len(ROWS), formats=formats)
                                           if delayed else None),
                                  hardware=hardware)
    return Holder(dense, experts)


def two_steps(holder: Holder, device: torch.device) -> list[torch.Tensor]:
    """Outputs and gradients of the second of two steps of the dense layer and the experts."""
    tokens, weight = seeded(sum(ROWS), 256, device=device, seed=1), 0.1 * seeded(256, 256, device=device, seed=2)
    stacked = 0.1 * seeded(len(ROWS), 256, 256, device=device, seed=3)
    grad_out = seeded(sum(ROWS), 256, device=device, seed=4)
    results = []
    for step in range(2):
        begin_step(holder)
        leaves = [tensor.clone().requires_grad_() for tensor in (tokens * (1 + step), weight, stacked)]
        dense = holder.layer.quantization.linear(leaves[0], leaves[1], None)
        experts = holder.experts.quantizations["up_weight"].linear(leaves[0], leaves[2],
                                                                   torch.tensor(ROWS, device=device))
        gradients = torch.autograd.grad((dense * grad_out).sum() + (experts * grad_out).sum(), leaves)
        finish_step(holder)
        results = [dense.detach(), experts.detach(), *gradients]
    return results


@pytest.mark.parametrize("name", RECIPES)
def test_hardware_fp8_gemms_compute_what_the_emulation_computes(gpu_device, name):
    recipe = recipe_on(name, gpu_device)
    hardware = two_steps(quantizations(recipe, True, gpu_device), gpu_device)
    emulated = two_steps(quantizations(Recipe(name, fp8_gemm="emulated"), False, gpu_device), gpu_device)
    labels = ("dense output", "expert output", "d tokens", "d dense weight", "d expert weights")
    for label, got, expected in zip(labels, hardware, emulated):
        assert got.dtype == torch.bfloat16 and torch.isfinite(got).all(), label
        error = float((got.double() - expected.double()).abs().max())
        assert error <= TOLERANCE * float(expected.double().abs().max()), (label, error)
    tokens = 2 * seeded(sum(ROWS), 256, device=gpu_device, seed=1)
    plain = tokens @ (0.1 * seeded(256, 256, device=gpu_device, seed=2)).t()
    assert not torch.equal(hardware[0], plain)  # it quantized


@pytest.mark.parametrize("depth", [2048, 8192])
def test_fast_accumulation_stays_close_to_the_exact_product(gpu_device, depth):
    """``use_fast_accum`` (the forward GEMM's default, ``precision.fp8_fast_accumulation=fprop``)
    keeps the running sums in the tensor cores' accumulator: at the contraction depths of the
    bench's layers its error against the fp64 product of the same FP8 operands stays a small
    fraction of the products' magnitude, as the split accumulator's does."""
    from meshlm.precision.formats.fp8 import E4M3, quantize_fp8_tensorwise
    from meshlm.precision.fp8_gemm import hardware_fp8_supported, scaled_matmul

    if not hardware_fp8_supported(gpu_device, "tensorwise", out_dtype=torch.float32):
        pytest.skip("this GPU runs no tensorwise FP8 GEMM")
    a = quantize_fp8_tensorwise(seeded(256, depth, device=gpu_device, seed=5).float(), E4M3)
    b = quantize_fp8_tensorwise(seeded(512, depth, device=gpu_device, seed=6).float(), E4M3)
    exact = (a.codes.double() * a.scales.double()) @ (b.codes.double() * b.scales.double()).t()
    magnitude = float(((a.codes.double() * a.scales.double()).abs() @
                       (b.codes.double() * b.scales.double()).abs().t()).max())
    for fast in (False, True):
        out = scaled_matmul(a.codes, a.scales, b.codes, b.scales, out_dtype=torch.float32, fast_accumulation=fast)
        error = float((out.double() - exact).abs().max())
        # 2^-6: room for accumulators of about 14 bits over 8192 terms (DeepSeek-V3 §3.3.2 saw errors
        # near 2% at K=4096), while a misread scale or layout is off by the products' own size
        assert error <= 2.0 ** -6 * magnitude, (fast, error / magnitude)
