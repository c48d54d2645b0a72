"""``Mistral3ForConditionalGeneration`` -> meshlm: the language model of Mistral's vision-language
folders (Mistral Small 3.1 and 3.2, Ministral 3), import only.

Their ``text_config`` is a ``mistral`` or ``ministral3`` model (``mistral.py``, ``ministral3.py``:
Llama's tensor names), kept in Llava's layout beside a Pixtral vision tower and its projector
(``multimodal.py``). The whole model's ``tie_word_embeddings`` (default true) decides whether the
head is the embedding, as transformers ties it. meshlm reads the language model alone; export
writes it as the text class its config fits (Ministral3ForCausalLM for Ministral 3's query scale,
else MistralForCausalLM or LlamaForCausalLM).
"""

from __future__ import annotations

import dataclasses

from meshlm.errors import ConfigError
from meshlm.hf import ministral3, mistral
from meshlm.hf.common import Architecture
from meshlm.hf.llama import tensor_maps
from meshlm.hf.multimodal import language_model_tensors
from meshlm.models.config import ModelConfig

NAME = "Mistral3ForConditionalGeneration"
TEXT_CLASSES = {"mistral": mistral.ARCHITECTURE, "ministral3": ministral3.ARCHITECTURE}
"""The language models a Mistral 3 folder may hold, by their text_config's model_type."""


def config_from_hf(hf_config: dict) -> ModelConfig:
    text = hf_config.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{NAME} config.json has no text_config; it is not a Mistral 3 folder meshlm reads.")
    kind = text.get("model_type", "mistral")
    if kind not in TEXT_CLASSES:
        raise ConfigError(f"{NAME} config.json: text_config has model_type {kind!r}; meshlm reads "
                          f"{', '.join(TEXT_CLASSES)} language models in these folders.")
    config = TEXT_CLASSES[kind].config_from_hf(text)
    tied = bool(hf_config.get("tie_word_embeddings", True))  # the whole model's field decides, as in transformers
    return config if tied == config.tie_embeddings else dataclasses.replace(config, tie_embeddings=tied)


def unsupported(config: ModelConfig) -> list[str]:
    return [f"meshlm holds only the language model of a {NAME} folder; export it as Ministral3ForCausalLM, "
            "MistralForCausalLM or LlamaForCausalLM"]


def config_to_hf(config: ModelConfig) -> dict:
    ARCHITECTURE.check_expressible(config)  # refuses: import only
    return {}


ARCHITECTURE = Architecture(NAME, "mistral3", config_from_hf, config_to_hf, tensor_maps, unsupported,
                            normalize_hf_tensors=language_model_tensors)
"""Import only: the text model of Mistral 3's vision-language folders."""
