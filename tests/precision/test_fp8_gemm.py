"""fp8_gemm.py: the hardware FP8 GEMM against the fp64 product of our own dequantized operands.

Tolerance on the CPU (fp32 accumulation). Every product of two FP8 numbers (at most 4 x 4
significant bits) is exact in fp32, so the kernel's only fp32 roundings are the K - 1 additions of
the dot product, one multiply per block scale (blockwise, tilewise) and the two scale multiplies;
the reference's dequantized values ``code * scale`` were rounded to fp32 once each (exact for
power-of-two scales). By the standard bound for recursive summation (Higham, "Accuracy and
Stability of Numerical Algorithms", §3.1), |fp32 result - exact| <= (K + 4) u sum_k |a_mk b_nk|
with u = 2^-24, in any summation order. Casting to bf16 adds at most 2^-8 of the result (8
significant bits).

On CUDA the bound is looser: Hopper's FP8 tensor cores keep only about 14 bits of a running sum
inside each 128-deep slice of K before cuBLAS (``use_fast_accum=False``) adds it into fp32
(DeepSeek-V3 §3.3.2), so we allow 2^-10 of sum_k |a_mk b_nk| on top -- room for the truncation
errors of 16 slices adding up in the same direction, and still far below what one misplaced scale
(a factor >= 2 on a whole tile) does.
"""

import math

import pytest
import torch

from meshlm.precision import fp8_gemm
from meshlm.precision.formats.blockwise import (
    quantize_fp8_tiles,
    quantize_fp8_weight_blocks,
)
from meshlm.precision.formats.fp8 import (
    E4M3,
    E5M2,
    quantize_fp8,
    quantize_fp8_tensorwise,
    scale_from_amax,
)
from meshlm.precision.fp8_gemm import (
    SCALINGS,
    TILE_SIZE,
    hardware_fp8_supported,
    infer_scaling,
    scaled_matmul,
    unsupported_reason,
)

FP32_UNIT_ROUNDOFF = 2.0 ** -24
TENSOR_CORE_ACCUMULATION = 2.0 ** -10
OUT_UNIT_ROUNDOFF = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -8}
FORMAT_PAIRS = [(E4M3, E4M3), (E4M3, E5M2), (E5M2, E4M3)]  # fprop / wgrad-style, and dgrad (E5M2 gradient first)
SHAPES = [(17, 33, 19), (32, 64, 48), (5, 300, 130), (64, 256, 16)]  # (M, K, N); most not multiples of 16
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


def random_operand(rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    """Gaussian values whose rows differ in magnitude by orders of magnitude, so per-row and per-tile scales differ."""
    row_magnitude = torch.exp(2 * torch.randn(rows, 1, generator=generator))
    return torch.randn(rows, cols, generator=generator) * row_magnitude


def quantize_operand(x: torch.Tensor, fmt, scaling: str, role: str):
    """``x [rows, K]`` quantized for ``scaling`` with the library's quantizers: role "a" (activation /
    gradient) or "b" (weight, or the second tiled operand of the weight gradient)."""
    if scaling == "tensorwise":
        return quantize_fp8_tensorwise(x, fmt)
    if scaling == "rowwise":
        return quantize_fp8(x, scale_from_amax(x.abs().amax(dim=1, keepdim=True), fmt), fmt)
    if scaling == "blockwise" and role == "b":
        return quantize_fp8_weight_blocks(x, fmt)
    return quantize_fp8_tiles(x, fmt)


def check_close_to_dequantized_product(out: torch.Tensor, a, b, out_dtype: torch.dtype) -> None:
    """``out`` within the module docstring's tolerance of the fp64 product of the dequantized operands."""
    a_values, b_values = a.values.double().cpu(), b.values.double().cpu()
    exact = a_values @ b_values.t()
    magnitude = a_values.abs() @ b_values.abs().t()
    accumulation = (a_values.shape[1] + 4) * FP32_UNIT_ROUNDOFF * magnitude
    if out.device.type == "cuda":
        accumulation = accumulation + TENSOR_CORE_ACCUMULATION * magnitude
    out_rounding = OUT_UNIT_ROUNDOFF[out_dtype]
    tolerance = accumulation * (1 + out_rounding) + out_rounding * exact.abs()
    error = (out.double().cpu() - exact).abs()
    assert out.dtype == out_dtype and out.shape == exact.shape
    assert bool((error <= tolerance).all()), f"worst error / tolerance: {(error / tolerance).max().item():.3g}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("formats", FORMAT_PAIRS, ids=lambda pair: f"{pair[0].name}x{pair[1].name}")
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_scaled_matmul_equals_the_product_of_dequantized_operands(device, scaling, formats, out_dtype):
    a_fmt, b_fmt = formats
    if not hardware_fp8_supported(device, scaling, a_fmt.dtype, b_fmt.dtype, out_dtype):
        pytest.skip(unsupported_reason(device, scaling, a_fmt.dtype, b_fmt.dtype, out_dtype))
    for rows, depth, cols in SHAPES:
        generator = torch.Generator().manual_seed(rows * 1000 + depth)
        a = quantize_operand(random_operand(rows, depth, generator).to(device), a_fmt, scaling, "a")
        b = quantize_operand(random_operand(cols, depth, generator).to(device), b_fmt, scaling, "b")
        same_layout = "rowwise" if scaling == "tilewise" and depth <= TILE_SIZE else scaling  # one K tile
        assert infer_scaling(a.codes, a.scales, b.codes, b.scales) == same_layout
        out = scaled_matmul(a.codes, a.scales, b.codes, b.scales, out_dtype)
        assert out.device.type == device
        check_close_to_dequantized_product(out, a, b, out_dtype)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="blockwise (1x128 / 128x128) scales need CUDA")
@pytest.mark.parametrize("scaling", ["blockwise", "tilewise"])
def test_blockwise_scales_on_cuda_at_training_shapes(scaling):
    """DeepSeek-V3's layouts on a Hopper GPU, at a size where every dim spans several tiles and blocks."""
    if not hardware_fp8_supported("cuda", scaling):
        pytest.skip(unsupported_reason("cuda", scaling, torch.float8_e4m3fn, torch.float8_e4m3fn, torch.bfloat16))
    generator = torch.Generator().manual_seed(0)
    a = quantize_operand(random_operand(300, 1000, generator).cuda(), E4M3, scaling, "a")
    b = quantize_operand(random_operand(520, 1000, generator).cuda(), E4M3, scaling, "b")
    check_close_to_dequantized_product(scaled_matmul(a.codes, a.scales, b.codes, b.scales, torch.bfloat16),
                                       a, b, torch.bfloat16)


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("formats", FORMAT_PAIRS, ids=lambda pair: f"{pair[0].name}x{pair[1].name}")
def test_cpu_runs_tensorwise_and_rowwise(scaling, formats):
    """torch 2.13's CPU ``_scaled_mm`` takes both; torch 2.11's only tensorwise (its own assert:
    "_scaled_mm only supports per-tensor scaling for CPU backend"), which the probe reports."""
    if scaling == "rowwise" and torch.__version__ < (2, 13):
        assert not hardware_fp8_supported("cpu", scaling, formats[0].dtype, formats[1].dtype)
        assert "per-tensor scaling" in unsupported_reason("cpu", scaling, formats[0].dtype, formats[1].dtype,
                                                          torch.bfloat16)
        return
    assert hardware_fp8_supported("cpu", scaling, formats[0].dtype, formats[1].dtype)
    assert hardware_fp8_supported(torch.device("cpu"), scaling, formats[0].dtype, formats[1].dtype, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scaling", SCALINGS)
def test_two_e5m2_operands_are_refused_with_one_sentence(device, scaling):
    assert hardware_fp8_supported(device, scaling, torch.float8_e5m2, torch.float8_e5m2) is False
    codes = torch.ones(4, 32, device=device).to(torch.float8_e5m2)
    scale = torch.ones((), device=device)
    with pytest.raises(NotImplementedError, match=r"not E5M2 x E5M2 .*hardware_fp8_supported") as raised:
        scaled_matmul(codes, scale, codes, scale)
    message = str(raised.value)
    assert "\n" not in message and message.endswith("where it is False.")


def test_unsupported_combinations_answer_false_without_raising():
    e4m3 = torch.float8_e4m3fn
    assert hardware_fp8_supported("cpu", "per_channel", e4m3, e4m3) is False
    assert hardware_fp8_supported("cpu", "tensorwise", torch.bfloat16, e4m3) is False
    assert hardware_fp8_supported("cpu", "tensorwise", e4m3, e4m3, torch.float8_e4m3fn) is False
    assert hardware_fp8_supported("not-a-device", "tensorwise", e4m3, e4m3) is False
    if not torch.cuda.is_available():
        assert hardware_fp8_supported("cuda", "tensorwise", e4m3, e4m3) is False


def test_an_unsupported_device_call_raises_the_probe_reason():
    if hardware_fp8_supported("cpu", "blockwise"):
        pytest.skip("this torch's CPU build runs blockwise scales")
    a = quantize_fp8_tiles(torch.randn(8, 200))
    b = quantize_fp8_weight_blocks(torch.randn(24, 200))
    expected = "cannot run a blockwise float8_e4m3fn x float8_e4m3fn product on cpu: .*emulated recipe"
    with pytest.raises(NotImplementedError, match=expected):
        scaled_matmul(a.codes, a.scales, b.codes, b.scales)


def test_scale_shapes_that_match_no_scaling_name_the_expected_ones():
    codes = torch.ones(8, 40).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"rowwise: \[8, 1\] and \[8, 1\]"):
        scaled_matmul(codes, torch.ones(8), codes, torch.ones(8))
    with pytest.raises(ValueError, match="out_dtype"):
        scaled_matmul(codes, torch.ones(()), codes, torch.ones(()), torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="FP8 codes"):
        scaled_matmul(codes.float(), torch.ones(()), codes, torch.ones(()))


def test_the_probe_runs_once_per_combination():
    fp8_gemm._probe.cache_clear()
    for _ in range(3):
        hardware_fp8_supported("cpu", "rowwise", torch.float8_e4m3fn, torch.float8_e5m2)
    assert fp8_gemm._probe.cache_info().misses == 1


def matches_torch_layout_check(scale: torch.Tensor, size: tuple[int, int], stride: tuple[int, int]) -> bool:
    """torch's ``check_size_stride`` (aten/src/ATen/native/cuda/ScaledBlas.cpp): sizes equal, and the
    stride of every dim longer than 1 equal."""
    strides_match = all(n <= 1 or scale.stride(dim) == s for dim, (n, s) in enumerate(zip(size, stride)))
    return tuple(scale.shape) == size and strides_match


@pytest.mark.parametrize("rows,cols,depth", [(20, 136, 300), (256, 768, 512), (5, 1, 2048)])
def test_block_scales_are_laid_out_as_torchs_cuda_checks_require(rows, cols, depth):
    """The layouts torch's CUDA ``_scaled_mm`` accepts (torch 2.9+), checked on the CPU: for the padded
    operands a [M, K] and b [N, K] (passed as b.t()), ``is_blockwise_1x128_scaling(a, scale_a)`` and
    ``is_blockwise_128x128_scaling(b, scale_b.t())`` / ``is_blockwise_1x128_scaling(b, scale_b.t())``,
    with the 128x128 row stride either ceil(K/128) or that rounded up to 4 (the two torch versions)."""
    generator = torch.Generator().manual_seed(0)
    padded_rows, padded_cols = rows + -rows % 16, cols + -cols % 16
    k_tiles = (depth + -depth % fp8_gemm.BLOCKED_K_MULTIPLE) // 128
    a_tiles = torch.rand(rows, math.ceil(depth / 128), generator=generator)
    for scaling, b_scale in [("blockwise", torch.rand(math.ceil(cols / 128), math.ceil(depth / 128))),
                             ("tilewise", torch.rand(cols, math.ceil(depth / 128)))]:
        scale_a, scale_b = fp8_gemm._kernel_scales(a_tiles, b_scale, scaling, padded_rows, padded_cols, k_tiles)
        assert matches_torch_layout_check(scale_a, (padded_rows, k_tiles), (1, padded_rows))
        if scaling == "blockwise":
            n_blocks = math.ceil(padded_cols / 128)
            for row_stride in (k_tiles, 4 * math.ceil(k_tiles / 4)):
                assert matches_torch_layout_check(scale_b.t(), (n_blocks, k_tiles), (row_stride, 1))
        else:
            assert matches_torch_layout_check(scale_b.t(), (padded_cols, k_tiles), (1, padded_cols))
        # and the values are where they were, padding set to 1
        assert torch.equal(scale_a[:rows, : a_tiles.shape[1]], a_tiles)
        assert torch.equal(scale_b.t()[: b_scale.shape[0], : b_scale.shape[1]], b_scale)
        assert bool((scale_b.t()[:, b_scale.shape[1]:] == 1).all())


def test_vector_entries_become_aligned_scales_eagerly_and_compiled():
    """Scales taken out of a vector (one per expert) start on 16-byte boundaries, which cuBLASLt
    asks of a scale pointer; ``scaled_matmul`` compiles with no graph break (reading a pointer
    broke the graph in every FP8 layer on the first GPU run) and its products equal eager ones."""
    vector = torch.arange(1.0, 6.0)
    spaced = fp8_gemm.aligned_entries(vector)
    assert torch.equal(spaced, vector) and all(spaced[i].data_ptr() % 16 == 0 for i in range(5))
    assert vector[1].data_ptr() % 16 != 0 and fp8_gemm._aligned(vector[1]).data_ptr() % 16 == 0
    if not hardware_fp8_supported("cpu", "tensorwise"):
        pytest.skip(unsupported_reason("cpu", "tensorwise", E4M3.dtype, E4M3.dtype, torch.float32))
    generator = torch.Generator().manual_seed(5)
    # codes inside E4M3's range: a value past it casts to a NaN code (torch 2.11 draws some here)
    a, b = (quantize_fp8_tensorwise(random_operand(rows, 64, generator), E4M3).codes for rows in (32, 48))
    assert not (a.float().isnan().any() or b.float().isnan().any())

    def product(amaxes):
        scales = fp8_gemm.aligned_entries(amaxes.abs() / 4)
        return scaled_matmul(a, scales[0], b, scales[2], out_dtype=torch.float32, verified=True)

    torch._dynamo.reset()
    compiled = torch.compile(product, fullgraph=True)  # fullgraph: a graph break is an error
    assert torch.equal(compiled(vector), product(vector))
