"""Hugging Face interop: read and write ``transformers`` checkpoints (config.json + safetensors).

Supported architectures: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM,
MistralForCausalLM, MixtralForCausalLM, Phi3ForCausalLM, Gemma3ForCausalLM, Olmo2ForCausalLM, Olmo3ForCausalLM,
Mamba2ForCausalLM and NemotronHForCausalLM, one adapter
module each (``llama.py``, ...), sharing
the tensor-map machinery of ``common.py``. ``convert.py`` converts whole folders and ``cli.py`` is
``meshlm convert``. transformers itself is not needed to convert, only to run the parity tests.
"""

from meshlm.hf.convert import (ARCHITECTURES, architecture_of, choose_architecture, export_hf, hf_to_meshlm,
                               load_hf_model, meshlm_to_hf)

__all__ = ["ARCHITECTURES", "architecture_of", "choose_architecture", "export_hf", "hf_to_meshlm", "load_hf_model",
           "meshlm_to_hf"]
