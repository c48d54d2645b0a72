"""Whole-model conversion between Hugging Face folders and meshlm models.

Import (``hf_to_meshlm``): read config.json, pick the adapter by its ``architectures`` entry
(or ``model_type``), translate the config, map the tensors (checked against the shapes the
config implies), build the model and save it as a meshlm model folder. The HF settings meshlm
does not model but generation needs (bos/eos/pad token ids, the context length) travel in the
meshlm config.json under ``"hf"``, together with the source architecture, so that export can
restore them and ``meshlm generate`` can find the eos id.

Export (``meshlm_to_hf``): the architecture is, in order, the one asked for, the one the model
was imported from (if it can still express the model), or the first that fits of Llama (dense
'*-' with RoPE), Qwen3-MoE / Mixtral (softmax-routed '*E'), Mamba2 ('MMM...') and Nemotron-H
(everything hybrid). When none fits, the error lists, per architecture, the fields that block it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from meshlm.checkpoint.files import CONFIG_FILE
from meshlm.checkpoint.model_files import load_model, load_state_checked, save_model
from meshlm.errors import CheckpointError, ConfigError
from meshlm.hf import llama, mamba2, mixtral, nemotron_h, qwen3_moe
from meshlm.hf.common import Architecture
from meshlm.hf.files import check_output_dir, read_hf_config, read_hf_tensors, write_hf_folder
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel

EXPORT_ORDER: tuple[Architecture, ...] = (llama.ARCHITECTURE, qwen3_moe.ARCHITECTURE, mixtral.ARCHITECTURE,
                                          mamba2.ARCHITECTURE, nemotron_h.ARCHITECTURE)
ARCHITECTURES: dict[str, Architecture] = {architecture.name: architecture for architecture in EXPORT_ORDER}
HF_EXTRA_KEY = "hf"
KEPT_HF_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings")


def architecture_of(hf_config: dict, source: str = "config.json") -> Architecture:
    """The adapter for an HF config, by its ``architectures`` entry, else its ``model_type``."""
    names = hf_config.get("architectures") or []
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    if not names:
        by_type = {architecture.model_type: architecture for architecture in EXPORT_ORDER}
        if hf_config.get("model_type") in by_type:
            return by_type[hf_config["model_type"]]
    found = ", ".join(names) or f"model_type {hf_config.get('model_type')!r}"
    raise CheckpointError(f"{source}: architecture {found} is not supported; meshlm converts "
                          f"{', '.join(ARCHITECTURES)}.")


def choose_architecture(config: ModelConfig, requested: str | None = None, original: str | None = None
                        ) -> Architecture:
    """The HF architecture to export ``config`` as (see the module docstring for the order)."""
    if requested is not None:
        if requested not in ARCHITECTURES:
            raise ConfigError(f"--architecture {requested!r} is not one of {', '.join(ARCHITECTURES)}.")
        ARCHITECTURES[requested].check_expressible(config)
        return ARCHITECTURES[requested]
    if original in ARCHITECTURES and not ARCHITECTURES[original].unsupported(config):
        return ARCHITECTURES[original]
    reasons = {}
    for architecture in EXPORT_ORDER:
        reasons[architecture.name] = architecture.unsupported(config)
        if not reasons[architecture.name]:
            return architecture
    detail = " | ".join(f"{name}: {'; '.join(why)}" for name, why in reasons.items())
    raise ConfigError(f"this model (pattern {config.pattern!r}) cannot be written as any supported Hugging Face "
                      f"architecture: {detail}.")


# --- import -------------------------------------------------------------------------------------
def load_hf_model(hf_dir: str | os.PathLike) -> tuple[LanguageModel, dict]:
    """The meshlm model held by an HF folder, and the ``"hf"`` extra config to keep with it."""
    hf_dir = Path(hf_dir)
    hf_config = read_hf_config(hf_dir)
    architecture = architecture_of(hf_config, str(hf_dir / CONFIG_FILE))
    try:
        config = architecture.config_from_hf(hf_config)
    except ConfigError as error:
        raise ConfigError(f"{hf_dir / CONFIG_FILE}: {error}") from error
    tensors = read_hf_tensors(hf_dir)
    try:
        state = architecture.state_from_hf(tensors, config)
    except CheckpointError as error:
        raise CheckpointError(f"{hf_dir}: {error}") from error
    with torch.device("meta"):
        model = LanguageModel(config)
    model = model.to_empty(device="cpu")
    load_state_checked(model, state, str(hf_dir))
    extra = {"architecture": architecture.name,
             **{name: hf_config[name] for name in KEPT_HF_FIELDS if hf_config.get(name) is not None}}
    return model, extra


def hf_to_meshlm(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, overwrite: bool = False
                 ) -> tuple[Path, LanguageModel, dict]:
    """Convert an HF folder into a meshlm model folder (tokenizer files are copied along)."""
    out_dir = Path(out_dir)
    check_output_dir(out_dir, overwrite)
    model, extra = load_hf_model(hf_dir)
    save_model(model, out_dir, extra_config={HF_EXTRA_KEY: extra}, tokenizer_dir=hf_dir)
    return out_dir, model, extra


# --- export -------------------------------------------------------------------------------------
def read_hf_extra(model_dir: Path) -> dict:
    """The ``"hf"`` section a meshlm config.json may carry (absent for models trained in meshlm)."""
    try:
        extra = json.loads((model_dir / CONFIG_FILE).read_text()).get(HF_EXTRA_KEY) or {}
    except (OSError, json.JSONDecodeError):
        return {}
    return extra if isinstance(extra, dict) else {}


def export_hf(model: LanguageModel, extra: dict | None = None, architecture: str | None = None
              ) -> tuple[dict, dict[str, torch.Tensor], Architecture]:
    """(HF config.json, HF tensors, chosen architecture) for a meshlm model, in memory."""
    extra = extra or {}
    config = model.config
    chosen = choose_architecture(config, architecture, extra.get("architecture"))
    hf_config = chosen.config_to_hf(config)
    hf_config.update({name: extra[name] for name in KEPT_HF_FIELDS if name in extra})
    state = {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}
    tensors = chosen.state_to_hf(state, config)
    hf_config["dtype"] = str(model.embedding.weight.dtype).removeprefix("torch.")
    return hf_config, tensors, chosen


def meshlm_to_hf(model_dir: str | os.PathLike, out_dir: str | os.PathLike, architecture: str | None = None,
                 overwrite: bool = False) -> tuple[Path, Architecture]:
    """Convert a meshlm model folder (or training checkpoint) into an HF folder."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    check_output_dir(out_dir, overwrite)
    model = load_model(model_dir)
    hf_config, tensors, chosen = export_hf(model, read_hf_extra(model_dir), architecture)
    write_hf_folder(out_dir, hf_config, tensors, tokenizer_dir=model_dir, overwrite=True)
    return out_dir, chosen
