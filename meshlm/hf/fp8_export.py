"""Block-wise FP8 Hugging Face export: DeepSeek-V3's weight format, as transformers loads it.

DeepSeek-V3 (2024, §3.3.2 "fine-grained quantization") stores each linear weight of its decoder
blocks in FP8 E4M3 with one fp32 scale per **128 x 128 block** (128 output x 128 input channels),
so one outlier costs precision only in its own block. Its released checkpoints, and transformers'
fine-grained FP8 loader (``FineGrainedFP8Config``, ``quantizers/quantizer_finegrained_fp8.py``),
read that as two tensors per quantized ``nn.Linear`` ``X``:

    X.weight            float8_e4m3fn  [out, in]                            the codes
    X.weight_scale_inv  float32        [ceil(out / 128), ceil(in / 128)]    one number per block

    weight[r, c] ~= X.weight[r, c] * X.weight_scale_inv[r // 128, c // 128]

"scale_inv" because it is what the dequantization *multiplies* by (the inverse of the factor
448 / amax the quantizer divided by). We store DeepSeek-V3's plain ``amax(block) / 448`` in fp32,
as its released checkpoints do, not rounded up to a power of two: transformers multiplies by any
fp32 scale (``codes.float() * scale``), and a power-of-two scale would shrink every code of the
block by up to a factor of 2, pushing its smallest weights into E4M3's subnormals (fewer bits) for
no gain. Rounding is to nearest-even with saturation (``meshlm/precision/formats/blockwise.py``),
so each weight's error is at most 2^-4 of it (3 mantissa bits), or 2^-10 of its block's scale
where it is tiny.

config.json gains ``"quantization_config": {"quant_method": "fp8", "activation_scheme":
"dynamic", "weight_block_size": [128, 128], "modules_to_not_convert": [...]}``. "dynamic" means
the activations are quantized per 1 x 128 tile at run time: nothing about them is stored. With
it, transformers swaps each ``nn.Linear`` (and each MoE ``experts`` module) for an FP8 one on a
GPU of compute capability 8.9 or more, and elsewhere -- on CPU -- dequantizes every weight to the
model's dtype while it loads.

What is quantized: the 2-D weights of the linear layers inside the decoder blocks (``layers.{i}``)
-- attention q/k/v/o (and multi-head latent attention's q_a/q_b/kv_a/kv_b projections, as
DeepSeek-V3's release), MLP gate/up/down (Mixtral's w1/w2/w3), Mamba in_proj/out_proj, each MoE
expert's linears and LatentMoE's fc1/fc2 latent projections -- and only when both dimensions are
multiples of 128. Embeddings, lm_head, norms, conv1d, routers, biases, A_log, D and dt_bias keep
the export dtype. The block rule is a loader constraint, not the format's: the format allows a
ragged last block (a ceil-sized grid), but transformers' dequantizing loader takes the block size
to be ``dim // grid`` and would read 200 rows with 2 scale rows as two blocks of 100, and its
fused MoE ``gate_up_proj`` concatenates the gate's and the up projection's grids. DeepSeek-V3
quantizes no ragged dimension either. A weight off the grid therefore stays high precision and is
listed in ``modules_to_not_convert`` (HF's module names; transformers maps them onto its own,
e.g. Mixtral's ``block_sparse_moe`` onto ``mlp``), together with ``lm_head``, which transformers
no longer skips by itself once the list is given, and every router, so that no reader swaps one
for an FP8 layer it has no scales for.

One exception to "listed means high precision": transformers (5.23) cannot build its FP8 experts
module for Nemotron-H (``FP8Experts`` looks for ``hidden_act``; Nemotron-H's non-gated experts use
``mlp_hidden_act``), so on a GPU its load would fail. Nemotron-H's routed experts are still
stored in FP8, but their ``experts`` modules are listed: transformers then keeps them as they
are and, since they hold no scale parameters, dequantizes their FP8 weights while loading, as it
does every weight on CPU.
"""

from __future__ import annotations

import re
from functools import partial

import torch

from meshlm.checkpoint.safetensors_stream import PlannedTensor
from meshlm.errors import ConfigError
from meshlm.hf.common import WrittenPair
from meshlm.precision.formats.blockwise import quantize_fp8_weight_blocks
from meshlm.precision.formats.fp8 import E4M3

FP8_BLOCK_SIZE = 128
"""Side of a weight block: one fp32 scale per 128 x 128 weights (DeepSeek-V3)."""
SCALE_SUFFIX = "_scale_inv"
"""``X.weight`` -> ``X.weight_scale_inv``."""
BLOCK_LINEARS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                           "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                           "w1", "w2", "w3", "in_proj", "out_proj", "fc1_latent_proj", "fc2_latent_proj"})
"""Last name of the HF ``nn.Linear`` modules inside a decoder block whose weights are quantized
(a router is ``gate``, and stays out)."""
EXPERTS_DEQUANTIZED_ON_LOAD = frozenset({"NemotronHForCausalLM"})
"""Architectures whose FP8 MoE experts transformers dequantizes at load (see the module docstring)."""
OUTPUT_HEAD = "lm_head"
IN_BLOCK = re.compile(r"(^|\.)layers\.\d+\.")
EXPERT = re.compile(r"^(.*\.experts)\.\d+\.")
MAX_LISTED = 8


def is_block_linear(name: str) -> bool:
    """Whether HF tensor ``name`` is the weight of a linear layer inside a decoder block."""
    module, _, leaf = name.rpartition(".")
    return leaf == "weight" and IN_BLOCK.search(name) is not None and module.rpartition(".")[2] in BLOCK_LINEARS


def fits_blocks(shape: tuple[int, ...]) -> bool:
    """A 2-D weight whose dimensions are both whole numbers of blocks (see the module docstring)."""
    return len(shape) == 2 and all(size > 0 and size % FP8_BLOCK_SIZE == 0 for size in shape)


def scale_grid(shape: tuple[int, ...]) -> tuple[int, int]:
    """Shape of ``weight_scale_inv`` for a weight [out, in]: one scale per block, ceil-sized."""
    return tuple(-(-size // FP8_BLOCK_SIZE) for size in shape)


def module_of(name: str) -> str:
    """The HF module a tensor belongs to, as ``modules_to_not_convert`` names it: an expert's
    linear belongs to its layer's ``experts`` module, which transformers converts as one."""
    expert = EXPERT.match(name)
    return expert.group(1) if expert else name.rpartition(".")[0]


def fp8_blocks_of(produce) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 codes, fp32 block scales) of the weight ``produce()`` gives."""
    quantized = quantize_fp8_weight_blocks(produce(), E4M3, power_of_two=False, block_size=FP8_BLOCK_SIZE)
    return quantized.codes, quantized.scales


def quantize_plan(plan: dict[str, PlannedTensor], experts_dequantized_on_load: bool = False
                  ) -> tuple[dict[str, PlannedTensor], list[str]]:
    """The HF tensor plan with each quantizable block linear replaced by its FP8 codes and
    ``weight_scale_inv``; and the modules transformers must not convert (``modules_to_not_convert``):
    those left in high precision, plus the FP8 ``experts`` modules if ``experts_dequantized_on_load``."""
    quantized, kept = {}, {OUTPUT_HEAD: None}
    for name, entry in plan.items():
        if is_block_linear(name) and fits_blocks(entry.shape):
            weight = WrittenPair(partial(fp8_blocks_of, entry.produce))  # codes, then their scales
            quantized[name] = PlannedTensor(entry.shape, E4M3.dtype, weight.first)
            quantized[name + SCALE_SUFFIX] = PlannedTensor(scale_grid(entry.shape), torch.float32, weight.second)
            if experts_dequantized_on_load and EXPERT.match(name):
                kept[module_of(name)] = None
            continue
        quantized[name] = entry
        if len(entry.shape) == 2 and name.endswith(".weight") and IN_BLOCK.search(name):
            kept[module_of(name)] = None  # routers, and linears off the block grid
    return quantized, list(kept)


def fp8_quantization_config(modules_to_not_convert: list[str]) -> dict:
    """config.json's ``quantization_config`` (the keys transformers' ``FineGrainedFP8Config`` reads)."""
    return {"quant_method": "fp8", "activation_scheme": "dynamic",
            "weight_block_size": [FP8_BLOCK_SIZE, FP8_BLOCK_SIZE], "modules_to_not_convert": modules_to_not_convert}


def quantize_fp8_export(hf_config: dict, plan: dict[str, PlannedTensor]) -> tuple[dict, dict[str, PlannedTensor]]:
    """(config.json, tensor plan) of an HF export with its block linears in block-wise FP8."""
    dequantized_on_load = bool(set(hf_config.get("architectures") or []) & EXPERTS_DEQUANTIZED_ON_LOAD)
    quantized, kept = quantize_plan(plan, experts_dequantized_on_load=dequantized_on_load)
    if len(quantized) == len(plan):
        raise ConfigError("--quantize fp8: no linear weight of this model has both dimensions a multiple of "
                          f"{FP8_BLOCK_SIZE}, the FP8 block size transformers loads, so nothing would be "
                          "quantized; export without --quantize.")
    return {**hf_config, "quantization_config": fp8_quantization_config(kept)}, quantized


def describe_fp8_export(hf_config: dict) -> str:
    """One line for the command's output: the modules transformers will not convert."""
    kept = hf_config["quantization_config"]["modules_to_not_convert"]
    shown = ", ".join(kept[:MAX_LISTED]) + (f" ... ({len(kept)} in all)" if len(kept) > MAX_LISTED else "")
    return (f"block linears in FP8 E4M3 with {FP8_BLOCK_SIZE}x{FP8_BLOCK_SIZE} block scales; "
            f"modules_to_not_convert: {shown}")
