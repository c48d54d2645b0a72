"""``SeedOssForCausalLM`` <-> meshlm (ByteDance Seed 2025, Seed-OSS-36B: a dense model with a 512k
context).

A Seed-OSS layer is Llama's -- RoPE attention with grouped KV heads of ``head_dim`` (128), a SwiGLU
MLP, RMSNorm -- with biases on q, k and v (``attention_bias``) and on o only with
``attention_out_bias`` (``model.attention_bias`` with ``model.attention_output_bias``), and MLP
biases with ``mlp_bias``. The tensors are Llama's (``llama.tensor_maps``).

Dropout (training only): ``attention_dropout`` is ``model.attention_dropout``, and
``residual_dropout`` -- after the attention's and the MLP's outputs -- is ``model.hidden_dropout``,
which also drops the embedding output, where Seed-OSS drops nothing (set it to 0 to fine-tune
without dropout, as the released config's 0.1 would otherwise apply).
"""

from __future__ import annotations

from meshlm.hf.common import Architecture, window_unsupported, with_defaults
from meshlm.hf.llama import dense_decoder_config, dense_decoder_to_hf, dense_decoder_unsupported, tensor_maps
from meshlm.models.config import ModelConfig

NAME = "SeedOssForCausalLM"
MODEL_TYPE = "seed_oss"
DEFAULTS = {"vocab_size": 155136, "hidden_size": 4096, "intermediate_size": 27648, "num_hidden_layers": 64,
            "num_attention_heads": 80, "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
            "max_position_embeddings": 524288, "initializer_range": 0.02, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False, "attention_bias": True, "attention_out_bias": False,
            "attention_dropout": 0.1, "residual_dropout": 0.1, "mlp_bias": False}


def config_from_hf(hf_config: dict) -> ModelConfig:
    hf = with_defaults(hf_config, DEFAULTS)
    bias, out_bias = bool(hf["attention_bias"]), bool(hf["attention_out_bias"])
    return dense_decoder_config(hf, hf_config, NAME, attention_bias=bias,
                                attention_output_bias=None if out_bias == bias else out_bias,
                                hidden_dropout=float(hf["residual_dropout"]))


def unsupported(config: ModelConfig) -> list[str]:
    reasons = dense_decoder_unsupported(config, "Seed-OSS", qk_norm=False, output_bias_apart=True)
    return reasons + window_unsupported(config, "Seed-OSS", uniform_only=False)


def config_to_hf(config: ModelConfig) -> dict:
    ARCHITECTURE.check_expressible(config)
    # explicit null token ids: Seed-OSS's defaults may lie outside a smaller vocabulary; the model's
    # own ids (from its "hf" record or its tokenizer) replace them
    return dense_decoder_to_hf(config, NAME, MODEL_TYPE, DEFAULTS["max_position_embeddings"],
                               attention_bias=config.attention_bias,
                               attention_out_bias=config.resolved_attention_output_bias, mlp_bias=config.mlp_bias,
                               residual_dropout=config.hidden_dropout, pad_token_id=None, bos_token_id=None,
                               eos_token_id=None)


ARCHITECTURE = Architecture(NAME, MODEL_TYPE, config_from_hf, config_to_hf, tensor_maps, unsupported)
state_from_hf = ARCHITECTURE.state_from_hf
state_to_hf = ARCHITECTURE.state_to_hf
