"""Hugging Face interop: read and write ``transformers`` checkpoints (config.json + safetensors).

Supported architectures: the classes of ``convert.EXPORT_ORDER`` (Llama, Qwen2/3, Qwen3-MoE,
Mistral, Ministral 3, Mixtral, OLMoE, Qwen2-MoE, DeepSeek-V3, GLM-4.5, dots.llm1, gpt-oss,
MiniMax-M2, GLM-4.7-Flash, Phi-3, Gemma 1/2/3, OLMo 2/3, EXAONE 4.0, GPT-2, GPTBigCode, StarCoder2, GPT-NeoX, StableLM, Falcon, Phi, GPT-J,
Command R, Cohere2, SmolLM3, Granite, Arcee, Granite MoE and 4.0-H, GLM, GLM-4, Seed-OSS, Hunyuan,
ERNIE 4.5 (dense and MoE), Mamba2, Bamba, Falcon-H1, Nemotron-H; the language models of Gemma 3's, Mistral 3's and
Qwen-VL's vision-language folders), one adapter module each (``llama.py``, ...),
sharing the tensor-map machinery of ``common.py``. ``convert.py`` converts whole folders and ``cli.py`` is ``meshlm
convert``. transformers itself is not needed to convert, only to run the parity tests.
"""

from meshlm.hf.convert import (ARCHITECTURES, architecture_of, choose_architecture, export_hf, hf_to_meshlm,
                               load_hf_model, meshlm_to_hf)

__all__ = ["ARCHITECTURES", "architecture_of", "choose_architecture", "export_hf", "hf_to_meshlm", "load_hf_model",
           "meshlm_to_hf"]
