"""Quantized linear layers (meshlm/precision/quantized_linear.py) under each recipe (recipes.py).

Each GEMM's operands are checked against the formats' own quantizers applied in the layout the
GEMM contracts over: fprop X and W along the input features, dgrad dY and W^T along the output
features, wgrad dY^T and X^T along the tokens. MXFP8's 1 x 32 blocks tell a transposed operand
from a transposed quantization, so they show the orientation is right. With the quantizers
replaced by the identity the layer is exactly ``F.linear`` (forward and gradients), NVFP4's
Hadamard transform of the wgrad operands included: the transform leaves dY^T X unchanged.
"""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshlm.errors import ConfigError
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel
from meshlm.precision.formats.blockwise import quantize_fp8_blockwise
from meshlm.precision.formats.fp8 import E4M3, E5M2, quantize_fp8_tensorwise
from meshlm.precision.formats.mxfp8 import quantize_mxfp8
from meshlm.precision.model_recipe import apply_recipe, is_quantized_block
from meshlm.precision.quantized_linear import QuantizedLinear, quantized_linear
from meshlm.precision.recipes import RECIPES, Recipe, build_recipe
from tests.helpers.scaled_mm import record_fast_accumulation

TOKENS, IN_FEATURES, OUT_FEATURES = 40, 64, 96


def operands(dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(2, TOKENS // 2, IN_FEATURES, generator=generator).to(dtype)
    weight = (torch.randn(OUT_FEATURES, IN_FEATURES, generator=generator) * 0.1).to(dtype)
    bias = torch.randn(OUT_FEATURES, generator=generator).to(dtype)
    grad_out = torch.randn(2, TOKENS // 2, OUT_FEATURES, generator=generator).to(dtype)
    return inputs, weight, bias, grad_out


def run(recipe, inputs, weight, bias, grad_out):
    leaves = [tensor.clone().requires_grad_() for tensor in (inputs, weight, bias)]
    out = quantized_linear(*leaves, recipe)
    grads = torch.autograd.grad(out, leaves, grad_out)
    return (out,) + grads


# Each recipe's quantizers, written with the formats directly: (activation or gradient along the
# last dim, weight [rows, cols] along its last dim with square blocks where the recipe has them).
def expected_quantizers(name):
    if name == "fp8_tensorwise":
        return (lambda t: quantize_fp8_tensorwise(t, E4M3).values, lambda t: quantize_fp8_tensorwise(t, E5M2).values,
                lambda w: quantize_fp8_tensorwise(w, E4M3).values)
    if name == "fp8_blockwise":
        tile = lambda t: quantize_fp8_blockwise(t, 1, 128).values  # noqa: E731
        return tile, tile, lambda w: quantize_fp8_blockwise(w, 128, 128).values
    mx = lambda t: quantize_mxfp8(t, E4M3).values  # noqa: E731
    return mx, mx, mx


@pytest.mark.parametrize("name", ["fp8_tensorwise", "fp8_blockwise", "mxfp8"])
def test_each_gemm_quantizes_its_operands_along_the_contraction(name):
    inputs, weight, bias, grad_out = operands()
    out, grad_inputs, grad_weight, grad_bias = run(Recipe(name), inputs, weight, bias, grad_out)
    activation, gradient, weight_q = expected_quantizers(name)
    x2, dy2 = inputs.reshape(-1, IN_FEATURES), grad_out.reshape(-1, OUT_FEATURES)
    torch.testing.assert_close(out, activation(inputs) @ weight_q(weight).t() + bias, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad_inputs, gradient(grad_out) @ weight_q(weight.t()).t(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad_weight, gradient(dy2.t()) @ activation(x2.t()).t(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad_bias, dy2.sum(0))
    plain = F.linear(inputs, weight, bias)
    assert 0 < (out - plain).abs().max() < 0.1 * plain.abs().max()  # quantized, and close


def test_mxfp8_blocks_follow_the_contraction_not_the_storage():
    """dgrad needs W^T quantized in 1 x 32 blocks along the output features: a transposed copy of
    W's own quantization (blocks along the input features) gives another result when the blocks
    differ -- here an outlier input feature, whose blocks in W push their neighbours below E4M3's
    range (power-of-two scales alone would round the same either way)."""
    inputs, weight, bias, grad_out = operands(seed=3)
    weight[:, 0] *= 1e4
    _, grad_inputs, _, _ = run(Recipe("mxfp8"), inputs, weight, bias, grad_out)
    mx = lambda t: quantize_mxfp8(t, E4M3).values  # noqa: E731
    right, wrong = mx(grad_out) @ mx(weight.t()).t(), mx(grad_out) @ mx(weight)
    torch.testing.assert_close(grad_inputs, right, rtol=1e-6, atol=1e-6)
    others = slice(1, None)  # the input features beside the outlier
    assert (grad_inputs - wrong)[..., others].abs().max() > 1e-2 * grad_inputs[..., others].abs().max()


@pytest.mark.parametrize("name", RECIPES[1:])
def test_with_identity_quantizers_the_layer_is_f_linear(name, monkeypatch):
    recipe = Recipe(name)
    monkeypatch.setattr(recipe, "quantize", lambda tensor, role, **kwargs: tensor)
    inputs, weight, bias, grad_out = (tensor.double() for tensor in operands())
    results = run(recipe, inputs, weight, bias, grad_out)
    leaves = [tensor.clone().requires_grad_() for tensor in (inputs, weight, bias)]
    plain = F.linear(*leaves)
    expected = (plain,) + torch.autograd.grad(plain, leaves, grad_out)
    for actual, wanted in zip(results, expected):
        torch.testing.assert_close(actual, wanted, rtol=1e-12, atol=1e-12)


def test_nvfp4_gradients_use_stochastic_rounding_and_the_rest_nearest():
    inputs, weight, bias, grad_out = operands(seed=5)
    first = run(Recipe("nvfp4", seed=1), inputs, weight, bias, grad_out)
    second = run(Recipe("nvfp4", seed=2), inputs, weight, bias, grad_out)
    same_seed = run(Recipe("nvfp4", seed=1), inputs, weight, bias, grad_out)
    assert torch.equal(first[0], second[0])  # forward: round-to-nearest-even, no randomness
    assert not torch.equal(first[1], second[1]) and not torch.equal(first[2], second[2])
    assert all(torch.equal(a, b) for a, b in zip(first, same_seed))
    plain = F.linear(inputs, weight, bias)
    assert (first[0] - plain).abs().max() < 0.3 * plain.abs().max()


def test_bf16_stays_bf16():
    inputs, weight, bias, grad_out = operands(torch.bfloat16)
    for name in RECIPES[1:]:
        results = run(Recipe(name), inputs, weight, bias, grad_out)
        assert all(tensor.dtype == torch.bfloat16 for tensor in results), name
        assert all(torch.isfinite(tensor).all() for tensor in results), name


def test_apply_recipe_keeps_the_ends_and_mtp_in_high_precision():
    config = ModelConfig(vocab_size=64, hidden_size=32, pattern="M*-E-*", num_attention_heads=4, mamba_head_dim=8,
                         mamba_state_size=8, ffn_hidden_size=48, moe_num_experts=4, moe_top_k=2,
                         moe_ffn_hidden_size=32, moe_latent_size=16, mtp_depth=1, mtp_pattern="*-")
    model = LanguageModel(config, seed=0)
    names_before = list(model.state_dict())
    count = apply_recipe(model, Recipe("fp8_tensorwise"), config.num_blocks, high_precision_layers=1)
    assert list(model.state_dict()) == names_before
    quantized = {name for name, module in model.named_modules() if isinstance(module, QuantizedLinear)}
    # blocks 1..4 of 0..5: attention q/k/v/o, SwiGLU MLP gate/up/down (twice), MoE latent in/out,
    # and the experts' three stacked weights (quantized_experts.py); not the router or the MTP depth
    assert len(quantized) == 4 + 3 + 2 + 3 and count == len(quantized) + 3
    assert set(model.blocks[3].mixer.experts.quantizations) == {"gate_weight", "up_weight", "down_weight"}
    assert all(name.startswith(("blocks.1.", "blocks.2.", "blocks.3.", "blocks.4.")) for name in quantized)
    assert [is_quantized_block(index, 6, 1) for index in range(8)] == [False, True, True, True, True, False,
                                                                       False, False]
    assert all(is_quantized_block(index, 6, 0) for index in range(8))
    assert all(type(module) is not QuantizedLinear or module.quantization is not None for module in model.modules())
    assert not any(isinstance(module, QuantizedLinear) for module in model.mtp.modules())
    assert isinstance(model.blocks[0].mixer.in_proj, nn.Linear) and type(model.blocks[0].mixer.in_proj) is nn.Linear


def test_recipe_errors_name_the_field():
    precision = lambda **fields: SimpleNamespace(**{"recipe": "nvfp4", "fp8_format": "hybrid", "dtype": "bf16",  # noqa: E731
                                                   "amax_history": 4, "nvfp4_hadamard": True,
                                                   "nvfp4_stochastic_rounding": True, "fp8_gemm": "auto",
                                                   "fp8_fast_accumulation": "fprop", **fields})
    assert build_recipe(precision(recipe="none", dtype="fp32")) is None
    assert build_recipe(precision()).name == "nvfp4"
    with pytest.raises(ConfigError, match="precision.recipe=nvfp4 quantizes the GEMMs of a bf16 run, but "
                                          "precision.dtype is fp16; set precision.dtype=bf16"):
        build_recipe(precision(dtype="fp16"))
    with pytest.raises(ConfigError, match="precision.dtype is fp32"):
        build_recipe(precision(dtype="fp32"))
    with pytest.raises(ConfigError, match="precision.recipe='fp4' is not one of none, fp8_tensorwise"):
        build_recipe(precision(recipe="fp4"))
    with pytest.raises(ConfigError, match="precision.fp8_format='e5m2' is not one of hybrid, e4m3"):
        build_recipe(precision(fp8_format="e5m2"))


@pytest.mark.parametrize("name", ["fp8_tensorwise", "fp8_delayed"])
def test_hardware_fp8_gemm_computes_what_the_emulation_computes(name):
    """precision.fp8_gemm=hardware multiplies the FP8 codes with torch._scaled_mm (on this CPU too):
    the same quantized operands, so forward and both gradients equal the emulated GEMMs on
    dequantized fp32 tensors to fp32 summation order (each dequantized operand is rounded once to
    fp32 in the emulation: 2^-24 relative)."""
    inputs, weight, bias, grad_out = operands()
    hardware = run(Recipe(name, fp8_gemm="hardware"), inputs, weight, bias, grad_out)
    emulated = run(Recipe(name, fp8_gemm="emulated"), inputs, weight, bias, grad_out)
    for actual, expected in zip(hardware, emulated):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    plain = F.linear(inputs, weight, bias)
    assert 0 < (hardware[0] - plain).abs().max() < 0.1 * plain.abs().max()  # quantized, and close


def test_hardware_fp8_gemm_is_refused_where_it_cannot_run():
    inputs, weight, bias, grad_out = operands()
    with pytest.raises(ConfigError, match="precision.fp8_gemm=hardware runs the FP8 recipes' GEMMs on FP8 codes, "
                                          "but precision.recipe=nvfp4 is emulated only"):
        run(Recipe("nvfp4", fp8_gemm="hardware"), inputs, weight, bias, grad_out)
    if not torch.cuda.is_available():  # this CPU build's _scaled_mm has no 128-block scales
        with pytest.raises(ConfigError, match="cannot run the FP8 GEMMs precision.recipe=fp8_blockwise needs"):
            run(Recipe("fp8_blockwise", fp8_gemm="hardware"), inputs, weight, bias, grad_out)
    auto = run(Recipe("fp8_blockwise", fp8_gemm="auto"), inputs, weight, bias, grad_out)  # falls back to emulation
    emulated = run(Recipe("fp8_blockwise", fp8_gemm="emulated"), inputs, weight, bias, grad_out)
    assert all(torch.equal(a, b) for a, b in zip(auto, emulated)) or torch.cuda.is_available()


@pytest.mark.parametrize("name", ["fp8_tensorwise", "fp8_delayed"])
def test_hardware_per_tensor_fp8_reuses_its_codes_bit_for_bit(name):
    """On the hardware GEMM a per-tensor recipe quantizes X, W and dY once and transposes their
    codes for the backward GEMMs (``quantized_projections._SavedCodesProjections``): the same products, bit for bit, as
    quantizing each transposed operand again (``_QuantizedLinear``), with only FP8 codes and
    their scales saved for backward (no bf16 copy of X or W)."""
    from meshlm.precision.delayed_scaling import DelayedScaling
    from meshlm.precision.fp8_gemm import hardware_fp8_supported
    from meshlm.precision.model_recipe import delayed_formats
    from meshlm.precision.quantized_linear import LinearQuantization, _QuantizedLinear

    if not hardware_fp8_supported("cpu", "tensorwise", out_dtype=torch.bfloat16):
        pytest.skip(f"torch {torch.__version__} runs no tensorwise torch._scaled_mm on this CPU")
    inputs, weight, bias, grad_out = (tensor.to(torch.bfloat16) for tensor in operands(seed=3))
    results, saved = [], []
    for path in ("codes", "again"):
        recipe = Recipe(name, fp8_gemm="hardware")
        delayed = None
        if name == "fp8_delayed":  # a history whose window differs from this step's amaxes
            delayed = DelayedScaling(4, torch.device("cpu"), formats=delayed_formats(recipe))
            delayed.history[1] = torch.tensor([7.0, 0.5, 3.0])
            delayed.refresh_scales()
            delayed.empty = False
        quantization = LinearQuantization(recipe, 0, {"input": (), "weight": (), "grad_output": ()}, delayed,
                                          hardware=True)
        leaves = [tensor.clone().requires_grad_() for tensor in (inputs, weight, bias)]
        dtypes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda tensor: dtypes.append(tensor.dtype) or tensor,
                                                      lambda tensor: tensor):
            out = (quantization.linear(*leaves) if path == "codes" else
                   _QuantizedLinear.apply(*leaves, quantization, True))
        results.append((out, *torch.autograd.grad(out, leaves, grad_out)))
        saved.append(dtypes)
    for actual, expected in zip(*results):
        assert torch.equal(actual, expected)
    assert set(saved[0]) == {torch.float8_e4m3fn, torch.float32}  # codes of X and W, fp32 scales
    assert set(saved[1]) == {torch.bfloat16}  # the general path keeps X and W in the run's dtype


@pytest.mark.parametrize("name", ["fp8_tensorwise", "fp8_delayed"])
@pytest.mark.parametrize("setting,expected", [("fprop", (True, False, False)), ("none", (False, False, False)),
                                              ("all", (True, True, True))])
@pytest.mark.parametrize("saved_codes", [True, False], ids=["saved-codes", "quantized-again"])
def test_fast_accumulation_goes_to_the_gemms_the_setting_names(monkeypatch, name, setting, expected, saved_codes):
    """precision.fp8_fast_accumulation: 'fprop' (Transformer Engine's default) lets only the forward
    GEMM keep its sums in the tensor cores; the two gradient GEMMs split their accumulator, on both
    hardware paths (codes kept for backward, or each operand quantized again)."""
    from meshlm.precision.fp8_gemm import hardware_fp8_supported
    from meshlm.precision.quantized_linear import LinearQuantization, _QuantizedLinear

    if not hardware_fp8_supported("cpu", "tensorwise", out_dtype=torch.bfloat16):
        pytest.skip(f"torch {torch.__version__} runs no tensorwise torch._scaled_mm on this CPU")
    inputs, weight, bias, grad_out = (tensor.to(torch.bfloat16) for tensor in operands(seed=5))
    quantization = LinearQuantization(Recipe(name, fp8_gemm="hardware", fast_accumulation=setting), 0,
                                      {"input": (), "weight": (), "grad_output": ()}, hardware=True)
    calls = record_fast_accumulation(monkeypatch)
    leaves = [tensor.clone().requires_grad_() for tensor in (inputs, weight, bias)]
    out = quantization.linear(*leaves) if saved_codes else _QuantizedLinear.apply(*leaves, quantization, True)
    torch.autograd.grad(out, leaves, grad_out)
    assert tuple(calls) == expected  # fprop, then dgrad and wgrad


def test_fast_accumulation_setting_is_checked():
    recipe = Recipe("fp8_tensorwise")
    assert recipe.fast_accumulation == "fprop"
    assert [recipe.accumulates_fast(gemm) for gemm in ("fprop", "dgrad", "wgrad")] == [True, False, False]
    with pytest.raises(ValueError, match="gemm='forward': expected 'fprop', 'dgrad' or 'wgrad'"):
        recipe.accumulates_fast("forward")


def test_delayed_scales_reach_the_hardware_gemm_as_tensors_of_their_own(monkeypatch):
    """Under fp8_delayed each GEMM's scales are the layer's window scales, handed to
    ``torch._scaled_mm`` as they are inside a compiled graph. There a view into a shared storage (the
    three operands' scales were columns of one tensor) failed Inductor's CUDA lowering on an H200
    and sent the block back to eager, so every scale that reaches the GEMM starts its own storage."""
    from meshlm.precision import fp8_gemm
    from meshlm.precision.delayed_scaling import OPERANDS, DelayedScaling
    from meshlm.precision.model_recipe import delayed_formats
    from meshlm.precision.quantized_linear import LinearQuantization

    if not fp8_gemm.hardware_fp8_supported("cpu", "tensorwise", out_dtype=torch.bfloat16):
        pytest.skip(f"torch {torch.__version__} runs no tensorwise torch._scaled_mm on this CPU")
    recipe = Recipe("fp8_delayed", fp8_gemm="hardware")
    delayed = DelayedScaling(4, torch.device("cpu"), formats=delayed_formats(recipe))
    delayed.history[1] = torch.tensor([7.0, 0.5, 3.0])
    delayed.refresh_scales()
    delayed.empty = False
    quantization = LinearQuantization(recipe, 0, {name: () for name in OPERANDS}, delayed, hardware=True)
    scales, real = [], fp8_gemm._scaled_mm_padded
    monkeypatch.setattr(fp8_gemm, "_scaled_mm_padded",
                        lambda a_codes, a_scale, b_codes, b_scale, *rest: scales.extend((a_scale, b_scale)) or
                        real(a_codes, a_scale, b_codes, b_scale, *rest))
    inputs, weight, bias, grad_out = (tensor.to(torch.bfloat16).requires_grad_() for tensor in operands(seed=4))
    torch.autograd.grad(quantization.linear(inputs, weight, bias), (inputs, weight), grad_out.detach())
    assert len(scales) == 6  # fprop, dgrad, wgrad
    assert {id(scale) for scale in scales} == {id(delayed.scale(operand)) for operand in OPERANDS}
    assert all(scale.storage_offset() == 0 and scale.untyped_storage().nbytes() == 4 for scale in scales)
