"""The language model inside a vision-language folder (Gemma 3's, Mistral 3's: Llava's layout; Qwen-VL's).

Such a folder keeps a vision tower and a projector beside a causal language model whose tensors
carry a prefix: ``language_model.model.*`` and ``language_model.lm_head.*`` in the hub files,
``model.language_model.*`` in transformers v5's. meshlm reads the language model alone, under the
names of the text-only class (``model.*``, ``lm_head.*``), and leaves the rest out; export writes
that text-only class.
"""

from __future__ import annotations

LANGUAGE_MODEL_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.",
                           "language_model.lm_head.": "lm_head."}
"""Where a multimodal folder keeps the language model's tensors (hub files; transformers v5), and
where the text-only class keeps them."""
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.",
                   "visual.", "model.visual.")
"""The tensors of the vision tower and the projector (Qwen-VL's vision encoder: ``visual``), which
meshlm leaves out."""


def language_model_tensors(tensors: dict) -> dict:
    """The language model's tensors of a multimodal folder, under the text-only class's names."""
    renamed = {}
    for name, tensor in tensors.items():
        if name.startswith(VISION_PREFIXES):
            continue
        for prefix, replacement in LANGUAGE_MODEL_PREFIXES.items():
            if name.startswith(prefix):
                name = replacement + name[len(prefix):]
                break
        renamed[name] = tensor
    return renamed


__all__ = ["LANGUAGE_MODEL_PREFIXES", "VISION_PREFIXES", "language_model_tensors"]
