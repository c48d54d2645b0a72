"""The hardware FP8 GEMM: multiply FP8 codes directly, with their fp32 scales, accumulating in fp32.

The FP8 recipes (``recipes.py``) emulate FP8 by quantizing each GEMM operand to FP8 codes plus fp32
scales (``formats/fp8.py``, ``formats/blockwise.py``) and multiplying the *dequantized* tensors in
bf16. FP8 tensor cores (NVIDIA compute capability 8.9 and 9.0: Ada, Hopper) multiply the codes
themselves, at twice bf16's rate, and apply the scales around the accumulation:

    out[m, n] = sum_k (a_codes[m, k] * a_scale[..]) * (b_codes[n, k] * b_scale[..])

with every product of two FP8 numbers exact in fp32 (at most 4 x 4 significant bits) and the sum
kept in fp32 (Micikevicius et al. 2022, "FP8 Formats for Deep Learning"). This file is a thin layer
over ``torch._scaled_mm``, whose arguments follow cuBLASLt's rules; ``scaled_matmul`` hides them:

- **Operand layout.** Both operands arrive with the contraction dim K last (``a [M, K]``,
  ``b [N, K]``, the way the recipes quantize them), and the result is ``a @ b^T``. The kernel wants
  ``a`` row-major and the second operand ``[K, N]`` column-major, which is exactly ``b.t()``.
- **Shapes.** cuBLASLt needs K and N to be multiples of 16 (16-byte rows of FP8). Short dims are
  padded with zero codes -- a zero adds nothing to any dot product -- and the result is sliced back.
- **Accumulation.** On Hopper the tensor cores keep only about 14 bits of the running sum, so by
  default cuBLAS moves partial sums into fp32 registers at intervals (DeepSeek-V3 §3.3.2,
  "increasing accumulation precision"; Transformer Engine's ``split_accumulator``), at some cost in
  speed. ``fast_accumulation=True`` (``use_fast_accum``) keeps the sums in the tensor cores: what
  Transformer Engine does for the forward GEMM and not for the two gradient GEMMs
  (``_2X_ACC_FPROP = False``, ``_2X_ACC_DGRAD = _2X_ACC_WGRAD = True`` in its linear module), and
  the recipes' default here (``precision.fp8_fast_accumulation``). Tensorwise and rowwise scales
  only: with block scales cuBLASLt applies each scale per 128-wide slice of the sum, which is the
  promotion itself, so those always split.
- **Formats.** E4M3 x E4M3, E4M3 x E5M2 and E5M2 x E4M3; **not E5M2 x E5M2**: NVIDIA's FP8 GEMM
  (cuBLASLt) offers no such pair and torch's CUDA path refuses it ("Multiplication of two
  Float8_e5m2 matrices is not supported"), so it is refused on every device here, the CPU included
  (whose ``_scaled_mm`` would run it). The hybrid recipe never needs it: E5M2 gradients always
  meet E4M3 weights or activations.

Scales are dequantization multipliers (``value = code * scale``, fp32), one of four layouts:

=================  ===============================  ===============================  =========================
``scaling``        ``a_scale``                      ``b_scale``                      used by
=================  ===============================  ===============================  =========================
``tensorwise``     0-dim                            0-dim                            ``fp8_tensorwise``
``rowwise``        ``[M, 1]``                       ``[N, 1]``                       per-row (torchao rowwise)
``blockwise``      ``[M, ceil(K/128)]`` 1x128 tiles ``[ceil(N/128), ceil(K/128)]``   ``fp8_blockwise`` fprop,
                                                    128x128 blocks                   dgrad (X W^T, dY W)
``tilewise``       ``[M, ceil(K/128)]`` 1x128 tiles ``[N, ceil(K/128)]`` 1x128 tiles ``fp8_blockwise`` wgrad
=================  ===============================  ===============================  =========================

The last two are DeepSeek-V3's fine-grained quantization (§3.3.2): activations and gradients per
1 x 128 tile, weights per 128 x 128 block; in the weight-gradient GEMM both operands are tiled along
the tokens. cuBLASLt applies such scales inside the K loop, once per 128-wide slice (CUDA >= 12.9,
compute capability 9.0 only). Its scale layouts, as ``torch._scaled_mm`` checks them (torch 2.9+,
``aten/src/ATen/native/cuda/ScaledBlas.cpp``): tile scales ``[rows, K/128]`` *outer-dim-major*
(stride ``(1, rows)``); block scales of the second operand passed as ``[K/128, N/128]`` with stride
``(1, K/128)`` -- a row-major ``[N/128, K/128]`` transposed -- whose row stride some torch versions
require to be rounded up to a multiple of 4 (16 bytes). For these two scalings K is therefore padded
to a multiple of 512 (4 tiles), where every version's rule coincides, and M to a multiple of 16.

Whether a combination runs is a property of this torch build and this device, not of the code:
``hardware_fp8_supported`` answers it by running one small product with uneven per-block scales and
comparing it with the dequantized product (a layout this file misreads would fail that comparison,
not just a missing kernel), once per combination, cached, never raising. Callers check it and fall
back to the emulated recipe; ``scaled_matmul`` refuses an unsupported combination with one sentence.
Measured: torch 2.13's CPU build runs tensorwise and rowwise (any shape, any out dtype), not the
blockwise layouts.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from meshlm.precision.formats.blockwise import TILE_SIZE, dequantize_fp8_blockwise

SCALINGS = ("tensorwise", "rowwise", "blockwise", "tilewise")
"""Scale layouts ``scaled_matmul`` accepts (module docstring); it infers which one from the shapes."""
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MIN_CAPABILITY = (8, 9)
"""FP8 tensor cores: Ada (8.9) and Hopper (9.0) onwards."""
SHAPE_MULTIPLE = 16
"""cuBLASLt's FP8 GEMM wants K and N (and, for tile scales, M) to be multiples of 16."""
BLOCKED_K_MULTIPLE = 4 * TILE_SIZE
"""With tile or block scales K is padded to whole groups of 4 tiles: the block scales' row stride is
then a multiple of 4 fp32 numbers (16 bytes), as every torch version's layout check accepts."""


ALIGNMENT_ENTRIES = 4
"""fp32 entries in 16 bytes, the alignment cuBLASLt asks of a scale pointer (``aligned_entries``)."""


def infer_scaling(a_codes: torch.Tensor, a_scale: torch.Tensor, b_codes: torch.Tensor,
                  b_scale: torch.Tensor) -> str:
    """Which of ``SCALINGS`` the scale shapes describe; a ValueError naming the expected shapes otherwise.

    Where two layouts share a shape (K <= 128, or N == 1) they describe the same numbers, and the
    simpler one is returned.
    """
    if a_codes.dim() != 2 or b_codes.dim() != 2 or a_codes.shape[1] != b_codes.shape[1]:
        raise ValueError(f"scaled_matmul multiplies a [M, K] by b [N, K] (contraction dim last in both), got shapes "
                         f"{tuple(a_codes.shape)} and {tuple(b_codes.shape)}; reshape to 2-D with matching K.")
    if a_codes.dtype not in FP8_DTYPES or b_codes.dtype not in FP8_DTYPES:
        raise ValueError(f"scaled_matmul takes FP8 codes (float8_e4m3fn or float8_e5m2), got {a_codes.dtype} and "
                         f"{b_codes.dtype}; quantize with meshlm.precision.formats first.")
    rows, cols = a_codes.shape[0], b_codes.shape[0]
    k_tiles = math.ceil(a_codes.shape[1] / TILE_SIZE)
    expected = {
        "tensorwise": ((), ()),
        "rowwise": ((rows, 1), (cols, 1)),
        "blockwise": ((rows, k_tiles), (math.ceil(cols / TILE_SIZE), k_tiles)),
        "tilewise": ((rows, k_tiles), (cols, k_tiles)),
    }
    for scaling, (a_shape, b_shape) in expected.items():
        if tuple(a_scale.shape) == a_shape and tuple(b_scale.shape) == b_shape:
            return scaling
    options = "; ".join(f"{name}: {list(a)} and {list(b)}" for name, (a, b) in expected.items())
    raise ValueError(f"scale shapes {list(a_scale.shape)} and {list(b_scale.shape)} match no scaling for a "
                     f"{list(a_codes.shape)} x {list(b_codes.shape)} product; use one of ({options}).")


def scaled_matmul(a_codes: torch.Tensor, a_scale: torch.Tensor, b_codes: torch.Tensor, b_scale: torch.Tensor,
                  out_dtype: torch.dtype = torch.bfloat16, verified: bool = False,
                  fast_accumulation: bool = False) -> torch.Tensor:
    """``(a_codes * a_scale) @ (b_codes * b_scale)^T`` on FP8 hardware, accumulated in fp32, in ``out_dtype``.

    ``a_codes [M, K]`` and ``b_codes [N, K]`` are FP8 (E4M3 or E5M2, not both E5M2) with K last;
    the scales are fp32 dequantization multipliers in one of the layouts of ``SCALINGS`` (module
    docstring), broadcast over their rows, tiles or blocks. ``out_dtype``: bf16, fp16 or fp32.
    Raises NotImplementedError when ``hardware_fp8_supported`` says this device cannot run it.

    ``verified=True``: the caller has already asked ``hardware_fp8_supported`` for this combination
    (as ``quantized_linear.hardware_gemm`` does once per layer), so the check is skipped. Inside a
    ``torch.compile``d block that matters: the check's probe makes a ``torch.Generator``, which
    TorchDynamo cannot trace, and would break the block's graph at every GEMM.

    ``fast_accumulation``: keep the running sums in the tensor cores' accumulator (module
    docstring, "Accumulation"); ignored with block scales, which always split.
    """
    a_scale = torch.as_tensor(a_scale, dtype=torch.float32, device=a_codes.device)
    b_scale = torch.as_tensor(b_scale, dtype=torch.float32, device=b_codes.device)
    scaling = infer_scaling(a_codes, a_scale, b_codes, b_scale)
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype={out_dtype} is not supported; use torch.bfloat16, torch.float16 or torch.float32.")
    fast = fast_accumulation and scaling in ("tensorwise", "rowwise")
    if verified:
        return _scaled_mm_padded(a_codes, a_scale, b_codes, b_scale, scaling, out_dtype, fast)
    reason = unsupported_reason(a_codes.device, scaling, a_codes.dtype, b_codes.dtype, out_dtype)
    if reason is not None:
        operands = " x ".join(str(dtype).removeprefix("torch.") for dtype in (a_codes.dtype, b_codes.dtype))
        raise NotImplementedError(f"scaled_matmul cannot run a {scaling} {operands} product on {a_codes.device}: "
                                  f"{reason}; check hardware_fp8_supported(...) first and use the emulated recipe "
                                  "where it is False.")
    return _scaled_mm_padded(a_codes, a_scale, b_codes, b_scale, scaling, out_dtype, fast)


def hardware_fp8_supported(device: torch.device | str, scaling: str, a_dtype: torch.dtype = torch.float8_e4m3fn,
                           b_dtype: torch.dtype = torch.float8_e4m3fn, out_dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether this torch on ``device`` runs ``scaled_matmul`` with ``scaling`` (one of ``SCALINGS``),
    ``a_dtype`` x ``b_dtype`` codes and ``out_dtype`` -- and gets the right numbers.

    Decided once per combination by a tiny probe (module docstring) and cached; never raises. CUDA
    needs compute capability >= 8.9; E5M2 x E5M2 is never supported (cuBLASLt has no such GEMM).
    """
    try:
        return unsupported_reason(device, scaling, a_dtype, b_dtype, out_dtype) is None
    except Exception:  # noqa: BLE001 -- a malformed device string, an odd dtype: "no", not a crash
        return False


def unsupported_reason(device: torch.device | str, scaling: str, a_dtype: torch.dtype, b_dtype: torch.dtype,
                       out_dtype: torch.dtype) -> str | None:
    """None where the combination runs (``hardware_fp8_supported``), else why not, in a few words."""
    if scaling not in SCALINGS:
        return f"scaling={scaling!r} is not one of {', '.join(SCALINGS)}"
    if a_dtype not in FP8_DTYPES or b_dtype not in FP8_DTYPES:
        return f"{a_dtype} x {b_dtype} are not both FP8 (float8_e4m3fn or float8_e5m2)"
    if a_dtype == b_dtype == torch.float8_e5m2:
        return ("NVIDIA's FP8 GEMM multiplies E4M3 x E4M3, E4M3 x E5M2 and E5M2 x E4M3 but not E5M2 x E5M2 (quantize "
                "one operand to E4M3, as the hybrid recipe does for weights and activations)")
    if out_dtype not in OUT_DTYPES:
        return f"out_dtype={out_dtype} is not bf16, fp16 or fp32"
    if not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no torch._scaled_mm"
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return "CUDA is not available"
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        capability = torch.cuda.get_device_capability(device)
        if capability < MIN_CAPABILITY:
            return (f"{torch.cuda.get_device_name(device)} has compute capability {capability[0]}.{capability[1]}, "
                    f"FP8 tensor cores need {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer")
    return _probe(device, scaling, a_dtype, b_dtype, out_dtype)


@functools.cache
def _probe(device: torch.device, scaling: str, a_dtype: torch.dtype, b_dtype: torch.dtype,
           out_dtype: torch.dtype) -> str | None:
    """Run one small product with uneven power-of-two scales (every dim ragged, so the padding runs
    too) and compare it with the dequantized product; None if it ran and agreed, else the reason."""
    rows, cols, depth = 20, 136, 300
    generator = torch.Generator().manual_seed(0)
    a_codes = torch.randn(rows, depth, generator=generator).to(a_dtype).to(device)
    b_codes = torch.randn(cols, depth, generator=generator).to(b_dtype).to(device)
    k_tiles, n_blocks = math.ceil(depth / TILE_SIZE), math.ceil(cols / TILE_SIZE)
    a_shape, b_shape = {"tensorwise": ((), ()), "rowwise": ((rows, 1), (cols, 1)),
                        "blockwise": ((rows, k_tiles), (n_blocks, k_tiles)),
                        "tilewise": ((rows, k_tiles), (cols, k_tiles))}[scaling]
    a_scale = torch.exp2(torch.randint(-2, 3, a_shape, generator=generator).float()).to(device)
    b_scale = torch.exp2(torch.randint(-2, 3, b_shape, generator=generator).float()).to(device)
    try:
        out = _scaled_mm_padded(a_codes, a_scale, b_codes, b_scale, scaling, out_dtype)
    except Exception as error:  # noqa: BLE001 -- any failure means "not on this build / device"
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0].rstrip(".")
        return f"torch {torch.__version__} refuses it ({first_line})"
    expected = _dequantized_product(a_codes, a_scale, b_codes, b_scale, scaling)
    # bf16 rounding is 0.4% of an entry, tensor-core accumulation less; one misread tile scale moves
    # many entries by a fifth of the largest
    tolerance = 2e-2 * expected.abs().max().item() + 2e-2 * expected.abs()
    if out.shape != expected.shape or not bool(((out.double().cpu() - expected).abs() <= tolerance).all()):
        return f"torch {torch.__version__} runs it but returns wrong numbers (an unexpected scale layout)"
    return None


def _scaled_mm_padded(a_codes: torch.Tensor, a_scale: torch.Tensor, b_codes: torch.Tensor, b_scale: torch.Tensor,
                      scaling: str, out_dtype: torch.dtype, fast_accumulation: bool = False) -> torch.Tensor:
    """``torch._scaled_mm`` on operands padded to the kernel's multiples, its result cut back to ``[M, N]``."""
    rows, cols = a_codes.shape[0], b_codes.shape[0]
    blocked = scaling in ("blockwise", "tilewise")
    depth_multiple = BLOCKED_K_MULTIPLE if blocked else SHAPE_MULTIPLE
    a_padded = _pad_codes(a_codes, SHAPE_MULTIPLE if blocked else 1, depth_multiple)
    b_padded = _pad_codes(b_codes, SHAPE_MULTIPLE, depth_multiple)
    scale_a, scale_b = _kernel_scales(_aligned(a_scale.to(a_codes.device, torch.float32)),
                                      _aligned(b_scale.to(b_codes.device, torch.float32)), scaling,
                                      a_padded.shape[0], b_padded.shape[0], a_padded.shape[1] // TILE_SIZE)
    out = torch._scaled_mm(a_padded, b_padded.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype,
                           use_fast_accum=fast_accumulation)
    return out if out.shape == (rows, cols) else out[:rows, :cols].contiguous()


def _aligned(scale: torch.Tensor) -> torch.Tensor:
    """``scale``, copied when its data does not start on a 16-byte boundary: cuBLASLt refuses such a
    scale pointer (CUBLAS_STATUS_NOT_SUPPORTED, seen on an H200 for one expert's scale taken out of
    the per-expert delayed-scaling vector at an offset of 8 bytes). Under ``torch.compile`` a
    pointer cannot be read (a graph break in every layer, seen on the same run) and Inductor drops
    a copy as a no-op, so there the scale is passed as it is: callers that hand out entries of a
    vector as scales space them with ``aligned_entries``."""
    if torch.compiler.is_compiling():
        return scale
    return scale if scale.data_ptr() % 16 == 0 else scale.clone()


def aligned_entries(vector: torch.Tensor) -> torch.Tensor:
    """``vector [n]`` (4-byte entries) copied into the first column of an ``[n, 4]`` buffer and
    returned as a strided ``[n]`` view of it: every entry ``i`` then starts on a 16-byte boundary,
    so ``result[i]`` can be a ``torch._scaled_mm`` scale, eagerly and in a compiled graph."""
    return vector.reshape(-1, 1).expand(-1, ALIGNMENT_ENTRIES).contiguous()[:, 0]


def _pad_codes(codes: torch.Tensor, row_multiple: int, col_multiple: int) -> torch.Tensor:
    """``codes [rows, cols]`` zero-padded at the end to the multiples, row-major. The padding goes
    through a uint8 view: the all-zero byte is +0 in both FP8 formats, and every torch pads bytes."""
    pad_rows, pad_cols = -codes.shape[0] % row_multiple, -codes.shape[1] % col_multiple
    if pad_rows or pad_cols:
        return F.pad(codes.view(torch.uint8), (0, pad_cols, 0, pad_rows)).view(codes.dtype)
    return codes.contiguous()


def _kernel_scales(a_scale: torch.Tensor, b_scale: torch.Tensor, scaling: str, rows: int, cols: int,
                   k_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The scales in the shapes and strides ``torch._scaled_mm`` expects for the padded operands
    ``[rows, K]`` and ``[cols, K]`` (``k_tiles = K / 128`` with tile or block scales). Padded rows and
    tiles get scale 1: their codes are zero anyway."""
    if scaling == "tensorwise":
        return a_scale.reshape(()), b_scale.reshape(())
    if scaling == "rowwise":  # a [M, 1], b as a row [1, N], both contiguous
        return _pad_scales(a_scale, rows, 1).contiguous(), _pad_scales(b_scale, cols, 1).reshape(1, cols).contiguous()
    a_tiles = _pad_scales(a_scale, rows, k_tiles).t().contiguous().t()  # [M, K/128], outer-dim-major
    if scaling == "blockwise":  # [N/128, K/128] row-major, handed over transposed
        return a_tiles, _pad_scales(b_scale, b_scale.shape[0], k_tiles).contiguous().t()
    return a_tiles, _pad_scales(b_scale, cols, k_tiles).t().contiguous()  # tilewise: b's tiles as [K/128, N]


def _pad_scales(scales: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``scales [r, c]`` padded with ones to ``[rows, cols]``."""
    return F.pad(scales, (0, cols - scales.shape[1], 0, rows - scales.shape[0]), value=1.0)


def _dequantized_product(a_codes: torch.Tensor, a_scale: torch.Tensor, b_codes: torch.Tensor,
                         b_scale: torch.Tensor, scaling: str) -> torch.Tensor:
    """The product ``scaled_matmul`` computes, from the dequantized operands, in fp64 on the CPU."""
    a_codes, a_scale, b_codes, b_scale = (t.cpu() for t in (a_codes, a_scale, b_codes, b_scale))
    if scaling in ("tensorwise", "rowwise"):
        a_values, b_values = a_codes.double() * a_scale.double(), b_codes.double() * b_scale.double()
    else:
        b_block_rows = TILE_SIZE if scaling == "blockwise" else 1
        a_values = dequantize_fp8_blockwise(a_codes, a_scale, 1, TILE_SIZE, torch.float64)
        b_values = dequantize_fp8_blockwise(b_codes, b_scale, b_block_rows, TILE_SIZE, torch.float64)
    return a_values @ b_values.t()


__all__ = ["FP8_DTYPES", "OUT_DTYPES", "SCALINGS", "hardware_fp8_supported", "infer_scaling", "scaled_matmul",
           "unsupported_reason"]
