"""MXFP4 Hugging Face export: gpt-oss's released expert format, as transformers and vLLM load it.

OpenAI released gpt-oss-20b and gpt-oss-120b with their MoE experts' weights in MXFP4 (OCP
Microscaling formats 1.0; ``meshlm/precision/formats/mxfp4.py``) and everything else in bf16:
about 90% of the parameters at 4.25 bits each, which is how the 120B model fits one 80 GB GPU.
``meshlm convert meshlm-to-hf --quantize mxfp4`` writes a gpt-oss model the same way, so a model
trained or fine-tuned here goes back to the tools that serve the release. Each decoder layer's

    mlp.experts.gate_up_proj    [E, d, 2F] bf16 (transposed, gate and up interleaved)
    mlp.experts.down_proj       [E, F, d]  bf16 (transposed)

becomes the released pair in the [out, in] layout, the rows of ``gate_up`` still interleaved:

    mlp.experts.gate_up_proj_blocks  [E, 2F, d / 32, 16] uint8    two E2M1 codes a byte
    mlp.experts.gate_up_proj_scales  [E, 2F, d / 32]     uint8    one E8M0 exponent per 32 inputs
    mlp.experts.down_proj_blocks     [E, d, F / 32, 16]  uint8
    mlp.experts.down_proj_scales     [E, d, F / 32]      uint8

The experts' biases, attention, the router, the embedding and the head keep the export's dtype.
config.json gets the release's ``"quantization_config": {"quant_method": "mxfp4",
"modules_to_not_convert": [...]}``. transformers then keeps the experts in MXFP4 where its
kernels run (a GPU with the ``kernels`` package) and otherwise dequantizes them to bf16 as it
loads, exactly as ``hf-to-meshlm`` does (``meshlm/hf/gpt_oss.py``), so an export read back is the
quantized model, bit for bit. Each expert's weights are quantized once, as the writer reaches
them; the blocks and scales of one tensor are made together and the scales handed over next.

Only gpt-oss has this layout in transformers (``GptOssForCausalLM``); other architectures are
refused with the FP8 export named instead. The experts' input widths (d, and F for the down
projection) must be multiples of 32, MXFP4's block (2880 in both released models).
"""

from __future__ import annotations

import re
from functools import partial

import torch

from meshlm.checkpoint.safetensors_stream import PlannedTensor
from meshlm.errors import ConfigError
from meshlm.hf.common import WrittenPair
from meshlm.precision.formats.mxfp4 import MXFP4_BLOCK_SIZE, quantize_mxfp4

GPT_OSS = "GptOssForCausalLM"
EXPERT_WEIGHT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj))$")
"""An HF gpt-oss expert weight [E, in, out], which MXFP4 stores as ``*_blocks`` and ``*_scales``."""
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
"""``modules_to_not_convert`` of the released gpt-oss configs."""


def mxfp4_experts_of(produce) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks [E, out, in / 32, 16], scales [E, out, in / 32]) of the stacked expert weight
    ``produce()`` gives as transformers holds it, [E, in, out]: quantized one expert at a time."""
    weights = produce()
    parts = [quantize_mxfp4(weights[expert].t()) for expert in range(weights.shape[0])]  # [out, in]: rows
    return torch.stack([part.blocks for part in parts]), torch.stack([part.scales for part in parts])


def quantize_mxfp4_export(hf_config: dict, plan: dict[str, PlannedTensor]) -> tuple[dict, dict[str, PlannedTensor]]:
    """(config.json, tensor plan) of a gpt-oss export with its experts in MXFP4 (the module docstring)."""
    architectures = hf_config.get("architectures") or []
    if architectures != [GPT_OSS]:
        raise ConfigError(f"--quantize mxfp4 writes gpt-oss's MXFP4 experts, a layout transformers reads for "
                          f"{GPT_OSS} only; this export is {', '.join(architectures) or 'of no architecture'}. "
                          "Use --quantize fp8, or leave --quantize out.")
    quantized = {}
    for name, entry in plan.items():
        match = EXPERT_WEIGHT.match(name)
        if match is None:
            quantized[name] = entry
            continue
        experts, inputs, outputs = entry.shape
        if inputs % MXFP4_BLOCK_SIZE:
            raise ConfigError(f"--quantize mxfp4: {name} has {inputs} input features, not a multiple of "
                              f"{MXFP4_BLOCK_SIZE} (MXFP4's block); give the model a hidden size and "
                              "model.moe_ffn_hidden_size that are, or leave --quantize out.")
        weight = WrittenPair(partial(mxfp4_experts_of, entry.produce))  # blocks, then their scales
        groups = inputs // MXFP4_BLOCK_SIZE
        quantized[name + "_blocks"] = PlannedTensor((experts, outputs, groups, MXFP4_BLOCK_SIZE // 2), torch.uint8,
                                                    weight.first)
        quantized[name + "_scales"] = PlannedTensor((experts, outputs, groups), torch.uint8, weight.second)
    if len(quantized) == len(plan):
        raise ConfigError("--quantize mxfp4: this gpt-oss export has no expert weights to quantize.")
    return {**hf_config, "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
            }, quantized


def describe_mxfp4_export(hf_config: dict) -> str:
    """One line for the command's output."""
    kept = ", ".join(hf_config["quantization_config"]["modules_to_not_convert"])
    return f"MoE experts in MXFP4 (E2M1, one E8M0 scale per {MXFP4_BLOCK_SIZE}); modules_to_not_convert: {kept}"


__all__ = ["NOT_CONVERTED", "describe_mxfp4_export", "quantize_mxfp4_export"]
