"""``CohereForCausalLM`` (Command R, Aya) <-> meshlm: attention and a SwiGLU MLP side by side through
one LayerNorm without a bias, RoPE over interleaved pairs of whole heads (reordered into meshlm's
rotate-half pairs), grouped KV heads, scaled logits, a tied head; Command R+'s LayerNorm weight per
head of q and k, its channels reordered with the rows."""

import pytest
import torch

pytest.importorskip("transformers")
from transformers import CohereConfig  # noqa: E402

from meshlm.errors import ConfigError  # noqa: E402
from meshlm.hf import choose_architecture, cohere  # noqa: E402
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.models.language_model import LanguageModel  # noqa: E402

from .helpers import VOCAB, assert_hf_round_trip, assert_meshlm_round_trip, convert_and_compare  # noqa: E402


def tiny_cohere(**overrides) -> CohereConfig:
    values = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, logit_scale=0.25, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    values.update(overrides)
    return CohereConfig(**values)


@pytest.mark.parametrize("overrides", [
    {},
    {"attention_bias": True, "tie_word_embeddings": False, "logit_scale": 0.5, "layer_norm_eps": 1e-6,
     "rope_parameters": {"rope_type": "default", "rope_theta": 8e6}},
    {"use_qk_norm": True, "num_attention_heads": 2, "num_key_value_heads": 1},
], ids=["command-r-like", "biased-untied", "command-r-plus-like-qk-norm"])
def test_logits_match_transformers_and_round_trip(overrides, tmp_path):
    hf_config = tiny_cohere(**overrides)
    model = convert_and_compare(hf_config, tmp_path)
    config = model.config
    assert config.parallel_residual and config.parallel_residual_shared_norm and not config.norm_bias
    assert config.logit_divisor == 1 / hf_config.logit_scale and "final_norm.bias" not in model.state_dict()
    assert config.qk_norm == config.qk_norm_per_head == hf_config.use_qk_norm
    assert_hf_round_trip(tmp_path, ("num_hidden_layers", "num_key_value_heads", "intermediate_size", "logit_scale",
                                    "layer_norm_eps", "attention_bias", "rope_parameters", "use_qk_norm"))


@pytest.mark.parametrize("qk_norm", [False, True], ids=["command-r", "command-r-plus"])
def test_a_command_r_shaped_meshlm_model_exports_as_cohere_and_back(qk_norm, tmp_path):
    torch.manual_seed(0)
    qk = dict(qk_norm=True, qk_norm_type="layernorm", qk_norm_per_head=True) if qk_norm else {}
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-*-", num_attention_heads=4, num_kv_heads=2,
                         norm="layernorm", norm_bias=False, parallel_residual=True, parallel_residual_shared_norm=True,
                         logit_divisor=8.0, tie_embeddings=True, ffn_hidden_size=48, **qk)
    model = LanguageModel(config)
    with torch.no_grad():  # trained norms: a mapping mistake cannot hide behind ones
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.1)
    assert choose_architecture(config).name == cohere.NAME
    assert_meshlm_round_trip(model, tmp_path, cohere.NAME)


def test_what_command_r_cannot_hold_is_refused_by_name():
    rms_qk = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-", num_attention_heads=4, norm="layernorm",
                         norm_bias=False, parallel_residual=True, parallel_residual_shared_norm=True, qk_norm=True,
                         qk_norm_per_head=True)
    with pytest.raises(ConfigError, match="model.qk_norm_type='rmsnorm' .Command R's QK-norm is a LayerNorm"):
        choose_architecture(rms_qk, requested=cohere.NAME)
    bias_free = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-", num_attention_heads=4, norm="layernorm",
                            norm_bias=False)
    with pytest.raises(ConfigError, match="model.norm_bias=False .only CohereForCausalLM"):
        choose_architecture(bias_free, requested="Starcoder2ForCausalLM")
    with pytest.raises(ConfigError, match="model.norm_bias=false drops LayerNorm's bias, and model.norm='rmsnorm'"):
        ModelConfig(pattern="*-", norm_bias=False)
