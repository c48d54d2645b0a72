"""Block-wise FP8 Hugging Face import: the released FP8 folders, dequantized as they are read.

DeepSeek-V3 and R1, Kimi K2, GLM-4.5's FP8 releases, Qwen3's ``-FP8`` models and MiniMax-M2 ship
their decoder linears in the fine-grained FP8 format ``fp8_export.py`` writes (DeepSeek-V3 2024,
§3.3.2; transformers' ``FineGrainedFP8Config``): per quantized weight ``X``,

    X.weight            float8_e4m3fn  [..., out, in]                   the codes
    X.weight_scale_inv  float32        [..., ceil(out / b0), ceil(in / b1)]   one number per block

    weight[r, c] = X.weight[r, c] * X.weight_scale_inv[r // b0, c // b1]

with config.json's ``"quantization_config": {"quant_method": "fp8", "weight_block_size": [b0, b1],
"activation_scheme": "dynamic"}`` (128 x 128 in every release). Import replaces each such pair by
one ``DerivedTensor`` that dequantizes when the writer reads it -- one weight (one expert's, where
the files keep experts apart) in memory at a time -- in the dtype config.json names (``dtype`` or
``torch_dtype``: bf16 for the releases, as DeepSeek's own ``fp8_cast_bf16.py`` and transformers'
dequantizing loader produce), so the adapters see an ordinary folder. Leading dims (stacked
experts) are blocked alike, each [out, in] slice on its own grid.

Refused with a reason: other quantization methods (GPTQ, AWQ, bitsandbytes, compressed-tensors,
...) unless the adapter reads them itself (``Architecture.quantizations``: gpt-oss's MXFP4), and
``activation_scheme: static`` (its activation scales are not modelled). The model trains and
exports in that dtype; ``meshlm convert meshlm-to-hf --quantize fp8`` writes the format back.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from meshlm.checkpoint.safetensors_stream import load
from meshlm.errors import CheckpointError, ConfigError
from meshlm.hf.common import DerivedTensor
from meshlm.hf.fp8_export import SCALE_SUFFIX

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
"""The codes' formats a scale grid may come with (E4M3 in every release)."""
DEQUANTIZED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""config.json's dtype names import dequantizes to; anything else (or none) gives bf16."""
DEFAULT_BLOCK = (128, 128)


def fp8_blocks(hf_config: dict, quantizations: tuple[str, ...], where: str) -> tuple[int, int] | None:
    """The block size of a block-wise FP8 folder, None when its weights are not FP8 (no quantization,
    or one the adapter reads itself); ConfigError naming ``where`` for what is not read."""
    quantization = hf_config.get("quantization_config")
    if not quantization:
        return None
    method = quantization.get("quant_method")
    if method in quantizations:
        return None
    if method != "fp8":
        readable = ", ".join(repr(name) for name in ("fp8", *quantizations))
        raise ConfigError(f"{where}: quantization_config.quant_method={method!r} is not read; meshlm reads "
                          f"{readable} folders (convert an unquantized copy of this checkpoint).")
    if quantization.get("activation_scheme", "dynamic") != "dynamic":
        raise ConfigError(f"{where}: quantization_config.activation_scheme={quantization['activation_scheme']!r} "
                          "stores activation scales meshlm does not model; only 'dynamic' FP8 folders are read.")
    block = quantization.get("weight_block_size") or DEFAULT_BLOCK
    if len(block) != 2 or not all(isinstance(size, int) and size > 0 for size in block):
        raise ConfigError(f"{where}: quantization_config.weight_block_size={block!r} must be two positive "
                          "integers (rows and columns of a block, [128, 128] in the released folders).")
    return int(block[0]), int(block[1])


def dequantized_dtype(hf_config: dict) -> torch.dtype:
    """The dtype FP8 weights become: config.json's ``dtype`` (``torch_dtype`` before transformers v5), else bf16."""
    name = hf_config.get("dtype") or hf_config.get("torch_dtype")
    return DEQUANTIZED_DTYPES.get(str(name), torch.bfloat16)


def scale_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The shape of the scales of weights ``shape`` [..., out, in]: [..., ceil(out / b0), ceil(in / b1)]."""
    return (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1]))


def dequantize_blocks(codes: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                      dtype: torch.dtype) -> torch.Tensor:
    """codes [..., out, in] times their block's scale, scale_inv [..., ceil(out / b0), ceil(in / b1)],
    in fp32, then ``dtype`` (the module docstring)."""
    rows, columns = codes.shape[-2:]
    grid = scale_grid(tuple(codes.shape), block)
    if tuple(scale_inv.shape) != grid:
        raise ValueError(f"a scale grid of shape {tuple(scale_inv.shape)} does not fit weights of shape "
                         f"{tuple(codes.shape)} in blocks of {block[0]} x {block[1]} (expected {grid[-2:]})")
    per_weight = scale_inv.float().repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return (codes.float() * per_weight[..., :rows, :columns]).to(dtype)


def _dequantized(codes, scale_inv, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    return dequantize_blocks(load(codes), load(scale_inv), block, dtype)


def dequantized_tensors(tensors: dict, block: tuple[int, int], dtype: torch.dtype, where: str | Path) -> dict:
    """``tensors`` (in memory or ``StoredTensor`` handles) with every FP8 weight and its scale grid
    replaced by one ``DerivedTensor`` of the weight in ``dtype``."""
    out = dict(tensors)
    for name, codes in tensors.items():
        if codes.dtype not in FP8_DTYPES:
            continue
        scale = tensors.get(name + SCALE_SUFFIX)
        if scale is None:
            raise ConfigError(f"{where}: {name} is stored in {codes.dtype} without its {name + SCALE_SUFFIX}; the "
                              "folder is not a block-wise FP8 checkpoint meshlm can read.")
        grid = scale_grid(tuple(codes.shape), block)
        if tuple(scale.shape) != grid:
            raise CheckpointError(f"{where}: {name + SCALE_SUFFIX} has shape {tuple(scale.shape)}, but {name} "
                                  f"{tuple(codes.shape)} in blocks of {block[0]} x {block[1]} needs {grid}.")
        out.pop(name + SCALE_SUFFIX)
        out[name] = DerivedTensor(tuple(codes.shape), dtype, partial(_dequantized, codes, scale, block, dtype))
    return out


__all__ = ["dequantize_blocks", "dequantized_dtype", "dequantized_tensors", "fp8_blocks", "scale_grid"]
