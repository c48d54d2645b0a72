"""Qwen's vision-language folders -> meshlm: their language model, import only.

``Qwen2VLForConditionalGeneration`` (Qwen2-VL), ``Qwen2_5_VLForConditionalGeneration`` (Qwen2.5-VL)
and ``Qwen3VLForConditionalGeneration`` (Qwen3-VL, dense) hold a vision encoder (``visual.*``; in
transformers v5's files ``model.visual.*``) beside a causal language model: Qwen2's layer (biases
on q, k and v; ``qwen2.py``) in the first two, Qwen3's (a QK-norm per head; ``qwen3.py``) in the
third, under ``model.*`` and ``lm_head.*`` (v5: ``model.language_model.*``). Its fields sit at
the top of config.json (the released Qwen2-VL and Qwen2.5-VL folders) or in ``text_config``.

**Their RoPE is multimodal** (M-RoPE, "Qwen2-VL", 2024, §2.1): each head's frequencies are cut
into ``mrope_section`` parts rotated by a token's temporal, height and width positions. A text
token's three positions are all its index in the sequence, so on text every part turns by that
one position and M-RoPE is the plain RoPE of the same base and frequencies (Qwen3-VL's interleaved
layout of the parts included). meshlm reads the language model for text: the vision encoder and
any image or video input are left out, and the model is the text-only class with plain RoPE
(tested against transformers' whole vision-language model on text). Export writes that class,
Qwen2ForCausalLM or Qwen3ForCausalLM.
"""

from __future__ import annotations

import dataclasses
from functools import partial

from meshlm.errors import ConfigError
from meshlm.hf import qwen2, qwen3
from meshlm.hf.common import Architecture
from meshlm.hf.llama import tensor_maps
from meshlm.hf.multimodal import language_model_tensors
from meshlm.models.config import ModelConfig

TEXT_CLASSES = {"Qwen2VLForConditionalGeneration": qwen2.ARCHITECTURE,
                "Qwen2_5_VLForConditionalGeneration": qwen2.ARCHITECTURE,
                "Qwen3VLForConditionalGeneration": qwen3.ARCHITECTURE}
"""Each vision-language class and the text class its language model is."""
MROPE_KEYS = ("mrope_section", "mrope_interleaved")


def text_config(hf_config: dict, name: str) -> dict:
    """The language model's config.json fields, its M-RoPE read as the plain RoPE it is on text."""
    text = hf_config.get("text_config")
    if text is None:  # the released Qwen2-VL and Qwen2.5-VL folders keep them at the top
        text = {key: value for key, value in hf_config.items() if key != "vision_config"}
    if not isinstance(text, dict):
        raise ConfigError(f"{name} config.json: text_config is not an object; it is not a folder meshlm reads.")
    text = dict(text)
    for key in ("rope_parameters", "rope_scaling"):
        rope = text.get(key)
        if isinstance(rope, dict):
            rope = {field: value for field, value in rope.items() if field not in MROPE_KEYS}
            if rope.get("type") == "mrope" or rope.get("rope_type") == "mrope":
                rope.pop("type", None)
                rope["rope_type"] = "default"
            text[key] = rope
    return text


def config_from(name: str, hf_config: dict) -> ModelConfig:
    config = TEXT_CLASSES[name].config_from_hf(text_config(hf_config, name))
    tied = hf_config.get("tie_word_embeddings")
    return config if tied is None or bool(tied) == config.tie_embeddings else dataclasses.replace(
        config, tie_embeddings=bool(tied))


def unsupported(name: str, config: ModelConfig) -> list[str]:
    return [f"meshlm holds only the language model of a {name} folder; export it as {TEXT_CLASSES[name].name}"]


def refused_export(name: str, config: ModelConfig) -> dict:
    raise ConfigError(f"this model cannot be written as {name}: {unsupported(name, config)[0]}.")


def architecture(name: str, model_type: str) -> Architecture:
    return Architecture(name, model_type, partial(config_from, name), partial(refused_export, name), tensor_maps,
                        partial(unsupported, name), normalize_hf_tensors=language_model_tensors)


QWEN2_VL = architecture("Qwen2VLForConditionalGeneration", "qwen2_vl")
QWEN2_5_VL = architecture("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl")
QWEN3_VL = architecture("Qwen3VLForConditionalGeneration", "qwen3_vl")
ARCHITECTURES = (QWEN2_VL, QWEN2_5_VL, QWEN3_VL)
"""Import only: the language models of Qwen's vision-language folders."""

__all__ = ["ARCHITECTURES", "QWEN2_5_VL", "QWEN2_VL", "QWEN3_VL", "text_config"]
