"""``meshlm convert meshlm-to-hf --quantize``: which quantized layout an export is written in.

- ``fp8``: the decoder blocks' linear weights in FP8 E4M3 with one fp32 scale per 128 x 128 block
  (DeepSeek-V3's layout, transformers' fine-grained FP8; any architecture): ``fp8_export.py``;
- ``mxfp4``: a gpt-oss model's MoE experts in MXFP4, as OpenAI released gpt-oss:
  ``mxfp4_export.py``.
"""

from __future__ import annotations

from meshlm.checkpoint.safetensors_stream import PlannedTensor
from meshlm.errors import ConfigError
from meshlm.hf.fp8_export import describe_fp8_export, quantize_fp8_export
from meshlm.hf.mxfp4_export import describe_mxfp4_export, quantize_mxfp4_export

QUANTIZERS = {"fp8": (quantize_fp8_export, describe_fp8_export),
              "mxfp4": (quantize_mxfp4_export, describe_mxfp4_export)}
QUANTIZE_CHOICES = tuple(QUANTIZERS)
"""Values of ``meshlm convert meshlm-to-hf --quantize``."""


def quantize_hf_export(hf_config: dict, plan: dict[str, PlannedTensor], quantize: str
                       ) -> tuple[dict, dict[str, PlannedTensor]]:
    """(config.json, tensor plan) of an HF export, quantized as ``--quantize`` asks."""
    if quantize not in QUANTIZERS:
        raise ConfigError(f"--quantize {quantize!r} is not supported; use --quantize "
                          f"{' or '.join(QUANTIZE_CHOICES)}, or leave it out to export the weights as they are stored.")
    return QUANTIZERS[quantize][0](hf_config, plan)


def describe_quantized_export(hf_config: dict) -> str:
    """One line for the command's output: what was quantized and what transformers leaves alone."""
    return QUANTIZERS[hf_config["quantization_config"]["quant_method"]][1](hf_config)


__all__ = ["QUANTIZE_CHOICES", "describe_quantized_export", "quantize_hf_export"]
