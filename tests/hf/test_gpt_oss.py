"""gpt-oss (``GptOssForCausalLM``, meshlm/hf/gpt_oss.py): a random transformers model's logits
(sinks, biased router and experts, the clamped SwiGLU, alternating windows, YaRN) reproduced
after import, and the round trip; an MXFP4 folder (the released checkpoints' expert format)
dequantized as transformers' own ``convert_moe_packed_tensors`` does, with the logits of the model
transformers builds from the same numbers; a meshlm model exported and read back, in bf16 and with
its experts in MXFP4 (``--quantize mxfp4``); the refusals."""

import json

import pytest
import torch

pytest.importorskip("transformers")
from transformers import GptOssConfig  # noqa: E402
from transformers.integrations.mxfp4 import convert_moe_packed_tensors  # noqa: E402

from meshlm.checkpoint.model_files import load_model  # noqa: E402
from meshlm.errors import ConfigError  # noqa: E402
from meshlm.hf import choose_architecture, gpt_oss, hf_to_meshlm  # noqa: E402
from meshlm.hf.files import write_hf_folder  # noqa: E402
from meshlm.hf.fp8_import import fp8_blocks  # noqa: E402
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.models.language_model import LanguageModel  # noqa: E402
from meshlm.precision.formats.mxfp4 import dequantize_mxfp4, quantize_mxfp4  # noqa: E402

from .helpers import (VOCAB, assert_hf_round_trip, assert_meshlm_round_trip, assert_same_logits,  # noqa: E402
                      convert_and_compare, exported_logits_match, random_ids, save_random_hf_model,
                      with_trained_norms_and_biases)


def tiny_gpt_oss(**overrides) -> GptOssConfig:
    values = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=5,
                  swiglu_limit=1.0)  # a limit the random model's projections reach: the clamps bite
    values.update(overrides)
    return GptOssConfig(**values)


def test_logits_match_transformers_and_round_trip(tmp_path):
    model = convert_and_compare(tiny_gpt_oss(), tmp_path, seq=24)
    config = model.config
    assert config.pattern == "*E*E*E" and config.sliding_window == 5 and config.sliding_window_pattern == "SF"
    assert config.attention_sinks and config.moe_router_bias and config.moe_expert_linear_bias
    assert (config.mlp_activation, config.swiglu_limit, config.moe_softmax_before_topk) == ("clamped_swiglu", 1.0,
                                                                                           False)
    assert (config.rope_scaling, config.rope_scaling_factor, config.rope_yarn_truncate) == ("yarn", 32.0, False)
    assert model.blocks[0].mixer.sinks.abs().sum() > 0 and model.blocks[1].mixer.experts.down_bias.abs().sum() > 0
    assert_hf_round_trip(tmp_path, ("num_hidden_layers", "intermediate_size", "num_local_experts",
                                    "num_experts_per_tok", "sliding_window", "layer_types", "swiglu_limit",
                                    "swiglu_alpha", "rope_parameters", "attention_bias"))


def test_layer_types_given_per_layer_are_followed(tmp_path):
    layer_types = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    model = convert_and_compare(tiny_gpt_oss(num_hidden_layers=4, layer_types=layer_types), tmp_path)
    assert [model.config.for_block(block).sliding_window for block in range(0, 8, 2)] == [None, 5, 5, None]


def random_mxfp4(shape: tuple, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 blocks [..., G, 16] (any codes) and scales [..., G] (2^-3 .. 2^0)."""
    blocks = torch.randint(0, 256, (*shape, 16), generator=generator, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(124, 128, shape, generator=generator, dtype=torch.int32).to(torch.uint8)
    return blocks, scales


def test_dequantization_is_transformers_own():
    generator = torch.Generator().manual_seed(0)
    blocks, scales = random_mxfp4((3, 10, 2), generator)
    ours = dequantize_mxfp4(blocks, scales, torch.float32)  # [3, 10, 64], the [out, in] layout
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [3, 64, 10], transposed
    assert torch.equal(ours, theirs.transpose(1, 2))
    assert set(ours.abs().unique().tolist()) > {0.0, 0.0625, 6.0}  # codes 0 .. 15 at scales 2^-3 .. 2^0
    assert torch.equal(dequantize_mxfp4(blocks, scales), ours.to(torch.bfloat16))  # bf16 holds them exactly
    with pytest.raises(ValueError, match="must be uint8"):
        dequantize_mxfp4(blocks.float(), scales)


def test_an_mxfp4_folder_imports_as_the_model_transformers_dequantizes(tmp_path):
    """The released layout: each block's experts as ``*_blocks`` / ``*_scales`` with a quantization
    config. transformers' model holding the dequantized numbers (its own conversion) is the reference."""
    hf_config = tiny_gpt_oss(hidden_size=64, intermediate_size=32, head_dim=16, num_hidden_layers=2)
    hf_model = save_random_hf_model(hf_config, tmp_path / "unused")
    generator = torch.Generator().manual_seed(3)
    state = {name: tensor.clone() for name, tensor in hf_model.state_dict().items()}
    with torch.no_grad():
        for layer in range(2):
            experts = hf_model.model.layers[layer].mlp.experts
            prefix = f"model.layers.{layer}.mlp.experts"
            for name, rows, inputs in (("gate_up_proj", 64, 64), ("down_proj", 64, 32)):  # [E, out, in / 32]
                blocks, scales = random_mxfp4((4, rows, inputs // 32), generator)
                getattr(experts, name).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                del state[f"{prefix}.{name}"]
                state.update({f"{prefix}.{name}_blocks": blocks, f"{prefix}.{name}_scales": scales})
    config_json = {**hf_config.to_dict(), "architectures": ["GptOssForCausalLM"],
                   "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "lm_head"]}}
    write_hf_folder(tmp_path / "mxfp4", config_json, state)
    out, _, _ = hf_to_meshlm(tmp_path / "mxfp4", tmp_path / "meshlm")
    model = load_model(out)
    assert model.blocks[1].mixer.experts.up_weight.dtype == torch.bfloat16  # dequantized, exactly
    assert_same_logits(hf_model.eval(), model.float(), random_ids())


def test_quantizations_gpt_oss_reads_are_mxfp4_and_block_fp8():
    assert gpt_oss.ARCHITECTURE.quantizations == ("mxfp4",)
    hf = {**tiny_gpt_oss().to_dict(), "quantization_config": {"quant_method": "awq"}}
    with pytest.raises(ConfigError, match="quant_method='awq' is not read; meshlm reads 'fp8', 'mxfp4' folders"):
        fp8_blocks(hf, gpt_oss.ARCHITECTURE.quantizations, "config.json")


def test_without_rope_parameters_gpt_oss_yarn_is_assumed():
    hf = {key: value for key, value in tiny_gpt_oss().to_dict().items()
          if key not in ("rope_parameters", "rope_scaling", "rope_theta")}
    config = gpt_oss.config_from_hf(hf)
    assert (config.rope_scaling, config.rope_theta, config.rope_original_max_positions) == ("yarn", 150000.0, 4096)


def gpt_oss_config(**overrides) -> ModelConfig:
    values = dict(vocab_size=VOCAB, hidden_size=32, pattern="*E*E", num_attention_heads=4, num_kv_heads=2,
                  attention_bias=True, attention_sinks=True, sliding_window=6, sliding_window_pattern="FS",
                  mlp_activation="clamped_swiglu", swiglu_limit=0.8, moe_num_experts=4, moe_top_k=2,
                  moe_ffn_hidden_size=16, moe_softmax_before_topk=False, moe_router_bias=True,
                  moe_expert_linear_bias=True, moe_aux_loss_coeff=0.01, init_std=0.2)
    values.update(overrides)
    return ModelConfig(**values)


def test_meshlm_model_exports_as_gpt_oss(tmp_path):
    torch.manual_seed(0)
    model = with_trained_norms_and_biases(LanguageModel(gpt_oss_config()))
    with torch.no_grad():
        for block in (0, 2):
            model.blocks[block].mixer.sinks.normal_(0.0, 1.0)
    assert_meshlm_round_trip(model, tmp_path, "GptOssForCausalLM")
    exported = json.loads((tmp_path / "hf_export" / "config.json").read_text())
    assert exported["layer_types"] == ["full_attention", "sliding_attention"] and "quantization_config" not in exported
    exported_logits_match(model, tmp_path)


def test_an_mxfp4_export_is_the_released_layout_and_loads_as_the_quantized_model(tmp_path):
    """``--quantize mxfp4``: each layer's experts as ``*_blocks`` / ``*_scales`` uint8 in the [out, in]
    layout (gate and up rows interleaved), the rest in bf16, the release's quantization config;
    transformers (dequantizing on this CPU) and ``hf-to-meshlm`` both read back the model whose
    expert weights are the MXFP4 values, bit for bit, and its logits."""
    from safetensors import safe_open

    from meshlm.checkpoint.model_files import save_model
    from meshlm.hf import meshlm_to_hf
    from meshlm.hf.mxfp4_export import NOT_CONVERTED

    torch.manual_seed(0)
    model = with_trained_norms_and_biases(LanguageModel(gpt_oss_config(moe_ffn_hidden_size=32))).to(torch.bfloat16)
    save_model(model, tmp_path / "ours")
    meshlm_to_hf(tmp_path / "ours", tmp_path / "mxfp4", quantize="mxfp4")
    config_json = json.loads((tmp_path / "mxfp4" / "config.json").read_text())
    assert config_json["quantization_config"] == {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    expected = LanguageModel(model.config).to(torch.bfloat16)
    expected.load_state_dict(model.state_dict())
    with safe_open(tmp_path / "mxfp4" / "model.safetensors", "pt") as stored:
        names = set(stored.keys())
        blocks = stored.get_tensor("model.layers.0.mlp.experts.gate_up_proj_blocks")
        assert blocks.dtype == torch.uint8 and blocks.shape == (4, 64, 1, 16)  # [E, 2F, d / 32, 16]
        assert stored.get_tensor("model.layers.0.mlp.experts.down_proj_scales").shape == (4, 32, 1)
        assert stored.get_tensor("model.layers.0.mlp.experts.gate_up_proj_bias").dtype == torch.bfloat16
    assert not {name for name in names if name.endswith(("gate_up_proj", "down_proj"))}
    with torch.no_grad():  # the same weights through the format: expert by expert, [out, in] rows
        for block in (1, 3):
            experts = expected.blocks[block].mixer.experts
            for name in ("gate_weight", "up_weight", "down_weight"):
                weight = getattr(experts, name)
                weight.copy_(dequantize_mxfp4(*quantize_mxfp4(weight)))
    assert not torch.equal(expected.blocks[1].mixer.experts.gate_weight, model.blocks[1].mixer.experts.gate_weight)
    out, _, _ = hf_to_meshlm(tmp_path / "mxfp4", tmp_path / "back")
    back = load_model(out)
    for name, tensor in expected.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path / "mxfp4", dtype=torch.float32).eval()
    assert_same_logits(hf_model, expected.float(), random_ids())


def test_mxfp4_export_is_gpt_oss_only_and_needs_whole_blocks(tmp_path):
    from meshlm.checkpoint.model_files import save_model
    from meshlm.hf import meshlm_to_hf

    save_model(LanguageModel(gpt_oss_config()), tmp_path / "narrow")  # experts of 16 inputs to down_proj
    with pytest.raises(ConfigError, match=r"down_proj has 16 input features, not a multiple of 32"):
        meshlm_to_hf(tmp_path / "narrow", tmp_path / "out", quantize="mxfp4")
    save_model(LanguageModel(ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-", num_attention_heads=4)),
               tmp_path / "llama")
    with pytest.raises(ConfigError, match=r"reads for GptOssForCausalLM only; this export is LlamaForCausalLM. "
                                          r"Use --quantize fp8"):
        meshlm_to_hf(tmp_path / "llama", tmp_path / "out2", quantize="mxfp4")
    with pytest.raises(ConfigError, match=r"--quantize 'int4' is not supported; use --quantize fp8 or mxfp4"):
        meshlm_to_hf(tmp_path / "llama", tmp_path / "out3", quantize="int4")


def test_what_gpt_oss_cannot_hold_is_refused_and_its_features_elsewhere():
    with pytest.raises(ConfigError, match=r"model.attention_sinks=False \(gpt-oss has attention_sinks=True\)"):
        gpt_oss.config_to_hf(gpt_oss_config(attention_sinks=False))
    with pytest.raises(ConfigError, match="gpt-oss layers are attention then MoE"):
        gpt_oss.config_to_hf(gpt_oss_config(pattern="*E*-"))
    with pytest.raises(ConfigError, match=r"model.moe_softmax_before_topk=True \(gpt-oss has"):
        gpt_oss.config_to_hf(gpt_oss_config(moe_softmax_before_topk=True))
    with pytest.raises(ConfigError, match=r"model.attention_sinks=True \(only GptOssForCausalLM"):
        choose_architecture(ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-", num_attention_heads=4,
                                        attention_sinks=True), requested="LlamaForCausalLM")
    with pytest.raises(ConfigError, match=r"model.moe_expert_linear_bias=True \(only GptOssForCausalLM"):
        choose_architecture(gpt_oss_config(attention_sinks=False, moe_router_bias=False, mlp_activation="swiglu",
                                           moe_softmax_before_topk=True, sliding_window=None,
                                           sliding_window_pattern="S"),
                            requested="Qwen3MoeForCausalLM")
    assert choose_architecture(gpt_oss_config()).name == "GptOssForCausalLM"  # chosen without being named
