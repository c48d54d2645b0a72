"""``Gemma3ForCausalLM`` (the Gemma 3 text model) <-> meshlm: sandwich norms, zero-centered norm
weights, scaled embeddings, GeGLU, QK-norm, five sliding layers to one full with their own RoPE base."""

import pytest
import torch

pytest.importorskip("transformers")
from transformers import Gemma3TextConfig  # noqa: E402

from meshlm.errors import ConfigError  # noqa: E402
from meshlm.hf import choose_architecture, gemma3  # noqa: E402
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.models.language_model import LanguageModel  # noqa: E402

from .helpers import VOCAB, assert_hf_round_trip, assert_meshlm_round_trip, convert_and_compare  # noqa: E402

ROPE = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}


def tiny_gemma3(**overrides) -> Gemma3TextConfig:
    """Six layers, so the fifth-sliding-one-full rule shows; a window of 5 under the 24 tokens compared."""
    values = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=6, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=5,
                  rms_norm_eps=1e-6, rope_parameters=ROPE)
    values.update(overrides)
    return Gemma3TextConfig(**values)


@pytest.mark.parametrize("overrides", [
    {},
    {"tie_word_embeddings": False, "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 5e5},
                                                       "sliding_attention": {"rope_type": "default",
                                                                             "rope_theta": 2e4}}},
    {"layer_types": ["sliding_attention", "full_attention"] * 3},
    {"query_pre_attn_scalar": 24},  # 27B's scale: hidden / heads (168), not head_dim (128)
], ids=["gemma3-1b-like", "untied-unscaled", "alternating", "27b-attention-scale"])
def test_logits_match_transformers_and_round_trip(overrides, tmp_path):
    hf_config = tiny_gemma3(**overrides)
    model = convert_and_compare(hf_config, tmp_path)
    config = model.config
    assert (config.pattern, config.mlp_activation) == ("*-" * 6, "geglu")
    assert config.qk_norm and config.block_output_norm and config.norm_zero_centered
    assert config.embedding_multiplier == 32 ** 0.5 and config.sliding_window == 5
    assert config.attention_scale == (None if hf_config.query_pre_attn_scalar == 16 else 24 ** -0.5)
    windows = [block.mixer.window for block in model.blocks if block.kind == "*"]
    assert windows == [5 if kind == "sliding_attention" else None for kind in hf_config.layer_types]
    thetas = [block.mixer.rotary.theta for block in model.blocks if block.kind == "*"]
    local, full = ROPE["sliding_attention"], ROPE["full_attention"]
    if "rope_parameters" in overrides:
        local, full = overrides["rope_parameters"]["sliding_attention"], overrides["rope_parameters"]["full_attention"]
    assert thetas == [local["rope_theta"] if window else full["rope_theta"] for window in windows]
    assert_hf_round_trip(tmp_path, ("num_hidden_layers", "head_dim", "intermediate_size", "sliding_window",
                                    "layer_types", "rope_parameters", "query_pre_attn_scalar", "tie_word_embeddings"))


def test_v4_config_fields_read_as_transformers_reads_them():
    """An older config.json: rope_theta / rope_scaling / rope_local_base_freq, sliding_window_pattern."""
    config = gemma3.config_from_hf({"architectures": [gemma3.NAME], "hidden_size": 32, "num_attention_heads": 4,
                                    "num_key_value_heads": 2, "head_dim": 8, "query_pre_attn_scalar": 8,
                                    "num_hidden_layers": 7, "sliding_window": 512, "rope_theta": 1e6,
                                    "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8}})
    assert (config.sliding_window, config.sliding_window_pattern) == (512, "SSSSSF")
    assert (config.rope_theta, config.rope_scaling, config.rope_scaling_factor) == (1e6, "linear", 8.0)
    assert config.rope_local_theta == 1e4
    sliding, full = config.for_block(0), config.for_block(10)  # layers 0 and 5
    assert (sliding.rope_theta, sliding.rope_scaling) == (1e4, "none") and (full.rope_theta, full.rope_scaling) == (
        1e6, "linear")


@pytest.mark.parametrize("fields, message", [
    ({"hidden_activation": "gelu"}, "hidden_activation='gelu' is not supported"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True is not supported"),
])
def test_what_meshlm_cannot_compute_is_refused_by_name(fields, message):
    base = {"architectures": [gemma3.NAME], "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 8, "query_pre_attn_scalar": 8, "num_hidden_layers": 2}
    with pytest.raises(ConfigError, match=message):
        gemma3.config_from_hf({**base, **fields})


def test_a_meshlm_gemma_style_model_exports_as_gemma3_and_others_refuse_it(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-*-*-", num_attention_heads=4, num_kv_heads=2,
                         head_dim=16, ffn_hidden_size=40, mlp_activation="geglu", qk_norm=True, block_output_norm=True,
                         norm_zero_centered=True, embedding_multiplier=32 ** 0.5, tie_embeddings=True,
                         sliding_window=6, sliding_window_pattern="SSF", rope_local_theta=10000.0, rope_theta=1e6)
    model = LanguageModel(config)
    with torch.no_grad():  # trained norms: a mapping mistake cannot hide behind zeros
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.1)
    assert choose_architecture(config).name == gemma3.NAME
    assert_meshlm_round_trip(model, tmp_path, gemma3.NAME)
    llama_like = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-", num_attention_heads=4,
                             block_output_norm=True)
    assert choose_architecture(llama_like).name == "Glm4ForCausalLM"  # a SwiGLU layer with sandwich norms
    with pytest.raises(ConfigError, match="model.block_output_norm=True .only Gemma2ForCausalLM, Gemma3ForCausalLM"):
        choose_architecture(llama_like, requested="LlamaForCausalLM")


def test_the_language_model_of_a_multimodal_folder_imports_and_exports_as_gemma3_text(tmp_path):
    """A Gemma3ForConditionalGeneration folder (a tiny SigLIP tower beside the language model):
    meshlm takes the language model, whose text logits equal transformers' on the whole model,
    and writes it back as Gemma3ForCausalLM."""
    from transformers import Gemma3Config, SiglipVisionConfig

    from meshlm.hf import meshlm_to_hf
    from meshlm.hf.convert import read_hf_extra

    from .helpers import load_hf

    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    text = tiny_gemma3().to_dict()
    multimodal = Gemma3Config(text_config=text, vision_config=vision.to_dict(), mm_tokens_per_image=4,
                              boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2, image_token_index=VOCAB - 1)
    model = convert_and_compare(multimodal, tmp_path)
    assert model.config.block_output_norm and model.config.sliding_window == 5
    assert read_hf_extra(tmp_path / "meshlm")["architecture"] == gemma3.MULTIMODAL_NAME
    meshlm_to_hf(tmp_path / "meshlm", tmp_path / "text")
    text_only = load_hf(tmp_path / "text")
    assert type(text_only).__name__ == gemma3.NAME
    ids = torch.randint(0, VOCAB - 3, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(text_only(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)
    from meshlm.cli import main as meshlm_main

    with pytest.raises(SystemExit):  # the CLI offers only the classes it writes
        meshlm_main(["convert", "meshlm-to-hf", str(tmp_path / "meshlm"), str(tmp_path / "x"),
                     "--architecture", gemma3.MULTIMODAL_NAME])
