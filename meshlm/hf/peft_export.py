"""A LoRA model's adapters alone, as a PEFT adapter folder: what the Hugging Face ecosystem loads.

    meshlm convert meshlm-to-hf runs/sft-lora hf/base --base-only      # the frozen model, once
    meshlm convert meshlm-to-hf runs/sft-lora hf/sft-adapter --adapter-only --base-model hf/base

A fine-tune with LoRA (``meshlm/models/lora.py``) changes a few million numbers of a model of
billions; shipping those alone is the point. PEFT's folder layout, which ``peft.PeftModel`` loads
onto the base model and which serving engines read for multi-adapter serving:

    adapter_config.json          peft_type LORA, task_type CAUSAL_LM, r, lora_alpha, target_modules
                                 (the Hugging Face names of the adapted layers), base_model_name_or_path
    adapter_model.safetensors    base_model.model.{HF module}.lora_A.weight   [r, in]   (our a)
                                 base_model.model.{HF module}.lora_B.weight   [out, r]  (our b)

PEFT's LoRA computes x A^T B^T times lora_alpha / r, the same detour as ours, so a and b are
written as they are (in their stored dtype). PEFT refuses adapters on the Mamba ``out_proj`` of
Mamba-2 and Nemotron-H models, so such an export is refused with the two ways out. The HF module of
each adapted layer is the one its weight is written to by the architecture's tensor maps
(``meshlm/hf/common.py``), which rename every linear layer of the blocks, so the adapter folder
fits the HF folder ``meshlm convert`` writes for the same model (with ``--base-only``: the frozen
weights, without the adapters). The adapters of MTP depths (DeepSeek-V3's and GLM-4.5's MTP
layers) are left out: transformers builds no MTP layer for PEFT to load them onto.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from meshlm.checkpoint.files import copy_tokenizer_files, write_json_atomic
from meshlm.checkpoint.safetensors_stream import PlannedTensor, write_safetensors
from meshlm.errors import CheckpointError
from meshlm.hf.common import Architecture
from meshlm.hf.files import check_output_dir
from meshlm.models.config import ModelConfig
from meshlm.models.lora import ADAPTER_MODULE, adapted_layer_names

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
"""What PEFT's ``PeftModel`` puts before the base model's module names in an adapter's keys."""
MAMBA_MODEL_TYPES = ("mamba2", "nemotron_h")
"""HF model types whose Mamba ``out_proj`` PEFT refuses to adapt: transformers' fused Mamba kernels
read that weight directly, past the module (peft's ``_check_lora_target_modules_mamba``)."""


def peft_adapter_plan(config: ModelConfig, stored: dict[str, tuple], read: Callable[[str], torch.Tensor],
                      architecture: Architecture, base_model: str | None = None) -> tuple[dict, dict]:
    """(adapter_config.json, {PEFT key: PlannedTensor}) of the adapters of a LoRA model
    (``meshlm_to_hf`` refuses a model without) whose tensors are ``stored`` ({name: (shape, dtype)},
    read by ``read``), for ``architecture``."""
    hf_names = {entry.ours: entry.theirs[0] for entry in architecture.tensor_maps(config)
                if len(entry.theirs) == 1 and not entry.stacked and entry.rows is None}  # (a fused HF layer,
    # as Phi-3's qkv_proj, is no PEFT target for one of its parts: such an adapter is refused below)
    plan, modules = {}, set()
    for layer in adapted_layer_names(stored):
        if layer.startswith("mtp."):  # transformers builds no MTP layer for PEFT to put these on; the
            continue  # merged export keeps the MTP depths, adapters merged in
        weight = hf_names.get(f"{layer}.weight")
        if weight is None:
            raise CheckpointError(f"{architecture.name} has no layer for the adapter of {layer}; export the merged "
                                  "model instead (without --adapter-only).")
        module = weight.removesuffix(".weight")
        for ours, theirs in (("a", "lora_A"), ("b", "lora_B")):
            key = f"{layer}.{ADAPTER_MODULE}.{ours}"
            shape, dtype = stored[key]
            plan[f"{PEFT_PREFIX}{module}.{theirs}.weight"] = PlannedTensor(tuple(shape), dtype,
                                                                          lambda key=key: read(key))
        modules.add(module.rsplit(".", 1)[-1])
    if architecture.model_type in MAMBA_MODEL_TYPES and "out_proj" in modules:
        raise CheckpointError(f"PEFT cannot load LoRA adapters on the Mamba out_proj of a {architecture.name} model "
                              "(transformers' fused Mamba kernels read that weight directly); export the merged model "
                              "instead (without --adapter-only), or train with model.lora_targets without out_proj.")
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": config.lora_rank, "lora_alpha": config.resolved_lora_alpha,
        "target_modules": sorted(modules), "lora_dropout": config.lora_dropout, "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
        "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
        "alpha_pattern": {},
    }
    return adapter_config, plan


def write_adapter_folder(directory: Path, adapter_config: dict, plan: dict, tokenizer_dir: Path | None = None,
                         overwrite: bool = False) -> Path:
    """Write a PEFT adapter folder (the tensors one at a time), with the model's tokenizer files."""
    check_output_dir(directory, overwrite)
    directory.mkdir(parents=True, exist_ok=True)
    write_safetensors(directory / ADAPTER_WEIGHTS_FILE, plan, metadata={"format": "pt"})
    write_json_atomic(directory / ADAPTER_CONFIG_FILE, adapter_config)
    if tokenizer_dir is not None:
        copy_tokenizer_files(Path(tokenizer_dir), directory)
    return directory


__all__ = ["ADAPTER_CONFIG_FILE", "ADAPTER_WEIGHTS_FILE", "PEFT_PREFIX", "peft_adapter_plan", "write_adapter_folder"]
