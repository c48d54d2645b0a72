"""``DeepseekV3ForCausalLM`` <-> meshlm (``meshlm/hf/deepseek_v3.py``): a random tiny DeepSeek-V3
(latent attention with and without a query latent, a dense first layer, group-limited sigmoid
routing with a non-zero expert bias, two shared experts' width) converts to meshlm with
transformers' logits and greedy tokens, and back to the same tensors and config fields."""

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402
from transformers import DeepseekV3Config  # noqa: E402

import meshlm  # noqa: E402
from meshlm.checkpoint.model_files import load_model, save_model  # noqa: E402
from meshlm.config import load_run_config  # noqa: E402
from meshlm.errors import CheckpointError, ConfigError  # noqa: E402
from meshlm.hf import choose_architecture, deepseek_v3, hf_to_meshlm, meshlm_to_hf  # noqa: E402
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.models.language_model import LanguageModel  # noqa: E402

from .helpers import (VOCAB, assert_hf_round_trip, assert_meshlm_round_trip, exported_logits_match,  # noqa: E402
                      random_ids, save_random_hf_model)

EXACT = 1e-5
"""fp32 logits of the two implementations agree to rounding (observed: about 1e-6)."""
PROMPT = [5, 17, 3, 42, 8, 1, 60]
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}
"""DeepSeek-V3's kind of YaRN, with an original context of 8 so the tests' 24 positions go past it."""
ROUND_TRIP_FIELDS = ("num_hidden_layers", "first_k_dense_replace", "num_attention_heads", "q_lora_rank",
                     "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size",
                     "moe_intermediate_size", "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "n_group",
                     "topk_group", "norm_topk_prob", "routed_scaling_factor", "rms_norm_eps", "rope_interleave",
                     "rope_parameters", "bos_token_id", "eos_token_id")


def tiny_deepseek_v3(**overrides) -> DeepseekV3Config:
    values = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=4,
                  first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                  n_shared_experts=2, num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                  q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, max_position_embeddings=32,
                  pad_token_id=None, bos_token_id=None, eos_token_id=None)
    values.update(overrides)
    return DeepseekV3Config(**values)


def convert(hf_config, tmp_path):
    """(transformers' random model, meshlm's conversion of it) after checking their logits agree."""
    hf_model = save_random_hf_model(hf_config, tmp_path / "hf")
    model = load_model(hf_to_meshlm(tmp_path / "hf", tmp_path / "meshlm")[0]).eval()
    ids = random_ids()
    with torch.no_grad():
        expected, actual = hf_model(ids).logits, model(ids).logits
    assert (expected - actual).abs().max() <= EXACT and expected.std() > 0.05
    return hf_model, model


def test_other_block_norm_eps_keeps_the_latent_norms_at_transformers_1e_6(tmp_path):
    """transformers' latent norms use 1e-6 whatever rms_norm_eps says: ``model.mla_latent_norm_eps``."""
    _, model = convert(tiny_deepseek_v3(rms_norm_eps=1e-2), tmp_path)  # large, so a wrong eps would show
    assert (model.config.norm_eps, model.config.mla_latent_norm_eps) == (1e-2, 1e-6)
    assert model.blocks[0].mixer.kv_a_norm.eps == 1e-6 and model.blocks[0].norm.eps == 1e-2
    assert_hf_round_trip(tmp_path, ROUND_TRIP_FIELDS)


@pytest.mark.parametrize("q_lora_rank", [32, None], ids=["query-latent", "q_proj"])
def test_logits_and_greedy_tokens_match_transformers_and_round_trip(q_lora_rank, tmp_path):
    hf_model, model = convert(tiny_deepseek_v3(q_lora_rank=q_lora_rank), tmp_path)
    config = model.config
    assert config.pattern == "*-*E*E*E" and config.attention_type == "mla"
    assert (config.mla_q_lora_rank, config.mla_kv_lora_rank, config.mla_v_head_dim) == (q_lora_rank, 16, 12)
    assert (config.moe_score_function, config.moe_router_num_groups, config.moe_router_group_top_k) == ("sigmoid", 2, 1)
    assert (config.moe_shared_expert_ffn_hidden_size, config.moe_routed_scaling_factor) == (32, 2.5)
    assert config.attention_scale is None and config.norm_eps == 1e-6
    bias = model.blocks[3].mixer.router.expert_bias
    assert torch.equal(bias, hf_model.model.layers[1].mlp.gate.e_score_correction_bias) and bias.abs().min() > 0
    with torch.no_grad():  # cached decoding on both sides: transformers' latent cache, meshlm's expanded one
        expected = hf_model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=10,
                                     min_new_tokens=10)[0, len(PROMPT):].tolist()
    assert meshlm.generate(model, PROMPT, max_new_tokens=10, greedy=True) == expected and len(set(expected)) > 2
    assert_hf_round_trip(tmp_path, ROUND_TRIP_FIELDS)


def test_yarn_scaling_and_its_attention_scale_match_transformers_and_round_trip(tmp_path):
    _, model = convert(tiny_deepseek_v3(rope_parameters=YARN), tmp_path)
    config = model.config
    mscale = 0.1 * math.log(4.0) + 1.0  # m(s, mscale_all_dim = 1): on both factors of the scores
    assert config.attention_scale == pytest.approx((16 + 8) ** -0.5 * mscale ** 2, rel=1e-15)
    assert (config.rope_scaling, config.rope_scaling_factor, config.rope_attention_factor) == ("yarn", 4.0, 1.0)
    assert_hf_round_trip(tmp_path, ROUND_TRIP_FIELDS + ("max_position_embeddings",))
    again = load_model(hf_to_meshlm(tmp_path / "hf_again", tmp_path / "meshlm again")[0])
    assert again.config == config
    unscaled = LanguageModel(dataclasses.replace(config, attention_scale=None))  # the scale is not vacuous
    unscaled.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert (unscaled.eval()(random_ids()).logits - model(random_ids()).logits).abs().max() > 1e-3


def tiny_meshlm_config(**overrides) -> ModelConfig:
    values = dict(vocab_size=VOCAB, hidden_size=32, pattern="*-*E", num_attention_heads=2, attention_type="mla",
                  mla_q_lora_rank=16, mla_kv_lora_rank=8, mla_qk_nope_head_dim=8, mla_qk_rope_head_dim=4,
                  mla_v_head_dim=6, ffn_hidden_size=48, norm_eps=1e-6, moe_num_experts=4, moe_top_k=2,
                  moe_ffn_hidden_size=8, moe_shared_expert_ffn_hidden_size=8, moe_score_function="sigmoid",
                  moe_normalize_topk=True, moe_routed_scaling_factor=1.5, moe_router_num_groups=2,
                  moe_router_group_top_k=1, moe_aux_loss_coeff=0.001, moe_aux_loss_type="sequence")
    values.update(overrides)
    return ModelConfig(**values)


def test_rotary_rows_are_interleaved_on_export_and_restored_on_import():
    config = tiny_meshlm_config()
    state = LanguageModel(config).state_dict()
    hub = deepseek_v3.state_to_hf(state, config)
    ours, theirs = state["blocks.0.mixer.q_b_proj.weight"], hub["model.layers.0.self_attn.q_b_proj.weight"]
    for head in range(2):  # each head: 8 unrotated rows as they are, then the rotary pairs (j, j + 2) -> (2j, 2j+1)
        start = head * 12
        assert torch.equal(theirs[start:start + 8], ours[start:start + 8])
        assert torch.equal(theirs[start + 8:start + 12:2], ours[start + 8:start + 10])
        assert torch.equal(theirs[start + 9:start + 12:2], ours[start + 10:start + 12])
    key, key_hf = state["blocks.0.mixer.kv_a_proj.weight"], hub["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]
    assert torch.equal(key_hf[:8], key[:8])  # the latent's rows, then the shared rotary key's
    assert torch.equal(key_hf[8::2], key[8:10]) and torch.equal(key_hf[9::2], key[10:])
    back = deepseek_v3.state_from_hf(hub, config)
    assert all(torch.equal(back[name], tensor) for name, tensor in state.items())


def test_meshlm_model_exports_as_deepseek_v3_with_its_logits_and_round_trips(tmp_path):
    torch.manual_seed(0)
    model = LanguageModel(tiny_meshlm_config())
    with torch.no_grad():
        model.blocks[3].mixer.router.expert_bias.normal_(0, 0.1)  # steers the choice, as in a trained model
    assert choose_architecture(model.config).name == "DeepseekV3ForCausalLM"
    exported_logits_match(model, tmp_path)
    assert_meshlm_round_trip(model, tmp_path, "DeepseekV3ForCausalLM")


def test_yarn_scale_of_a_meshlm_model_round_trips(tmp_path):
    """The scale and YaRN factor that DeepSeek-V2-Lite-style mscale 0.8 and mscale_all_dim 0.5 give
    are written back as that pair (and read again as the same two numbers)."""
    scale = deepseek_v3.scale_from_mscale(12, 8.0, 0.5)
    factor = deepseek_v3.yarn_mscale(8.0, 0.8) / deepseek_v3.yarn_mscale(8.0, 0.5)
    config = tiny_meshlm_config(rope_scaling="yarn", rope_scaling_factor=8.0, rope_original_max_positions=4,
                                attention_scale=scale, rope_attention_factor=factor)
    parameters = deepseek_v3.config_to_hf(config)["rope_parameters"]
    assert (parameters["mscale"], parameters["mscale_all_dim"]) == (0.8, 0.5) and "attention_factor" not in parameters
    torch.manual_seed(0)
    model = LanguageModel(config)
    exported_logits_match(model, tmp_path)
    assert_meshlm_round_trip(model, tmp_path, "DeepseekV3ForCausalLM")


def test_fused_experts_are_read_and_mtp_layers_skipped():
    config = tiny_meshlm_config(pattern="*E")
    state = LanguageModel(config).state_dict()
    hub = deepseek_v3.state_to_hf(state, config)
    experts = "model.layers.0.mlp.experts"
    fused = {name: tensor for name, tensor in hub.items() if not name.startswith(experts)}
    gate, up, down = (torch.stack([hub[f"{experts}.{e}.{name}.weight"] for e in range(4)])
                      for name in ("gate_proj", "up_proj", "down_proj"))
    fused.update({f"{experts}.gate_up_proj": torch.cat((gate, up), dim=1), f"{experts}.down_proj": down})
    # DeepSeek-V3's layer 61: an MTP module after the last decoder layer, which transformers skips too
    fused.update({"model.layers.1.eh_proj.weight": torch.zeros(32, 64), "model.layers.1.enorm.weight": torch.ones(32),
                  "model.layers.1.self_attn.kv_b_proj.weight": torch.zeros(28, 8)})
    back = deepseek_v3.state_from_hf(fused, config)
    assert all(torch.equal(back[name], tensor) for name, tensor in state.items())
    del hub["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]
    with pytest.raises(CheckpointError, match=r"missing tensors model\.layers\.0\.self_attn\.kv_a_proj_with_mqa"):
        deepseek_v3.state_from_hf(hub, config)


def test_adapters_on_reordered_projections_are_refused_for_peft(tmp_path):
    """A LoRA B on q_proj would need its rotary rows reordered too, which a PEFT folder cannot say."""
    config = tiny_meshlm_config(mla_q_lora_rank=None, lora_rank=2, lora_targets=["q_proj"])
    save_model(LanguageModel(config), tmp_path / "lora")
    with pytest.raises(CheckpointError, match=r"no layer for the adapter of blocks\.0\.mixer\.q_proj"):
        meshlm_to_hf(tmp_path / "lora", tmp_path / "adapter", part="adapter")


@pytest.mark.parametrize("field, value, message", [
    ("rope_interleave", False, r"rope_interleave=False is not supported yet"),
    ("moe_layer_freq", 2, r"moe_layer_freq=2 is not supported yet"),
    ("hidden_act", "gelu", r"hidden_act='gelu' is not supported yet"),
    ("attention_bias", True, r"attention_bias=True is not supported yet"),
    ("n_shared_experts", 0, r"n_shared_experts=0 is not supported"),
])
def test_unreadable_config_json_is_refused_by_field(field, value, message):
    hf_config = tiny_deepseek_v3().to_dict()
    with pytest.raises(ConfigError, match=message):
        deepseek_v3.config_from_hf({**hf_config, field: value})


def test_config_details_from_config_json():
    hf_config = tiny_deepseek_v3(n_group=1, topk_group=1, first_k_dense_replace=9).to_dict()
    dense = deepseek_v3.config_from_hf(hf_config)
    assert dense.pattern == "*-*-*-*-" and dense.moe_router_num_groups is None
    kimi_like = deepseek_v3.config_from_hf({**hf_config, "first_k_dense_replace": 1, "aux_loss_alpha": 0.001,
                                            "seq_aux": True})
    assert kimi_like.pattern == "*-*E*E*E" and kimi_like.moe_router_num_groups is None
    assert (kimi_like.moe_aux_loss_coeff, kimi_like.moe_aux_loss_type) == (0.001, "sequence")


@pytest.mark.parametrize("overrides, message", [
    ({"attention_type": "gqa", "mla_q_lora_rank": None}, "model.attention_type='gqa'"),
    ({"moe_score_function": "softmax"}, "model.moe_score_function='softmax'"),
    ({"norm_eps": 1e-5}, r"model.mla_latent_norm_eps=None with model.norm_eps=1e-05 \(DeepseekV3ForCausalLM's "
                         r"latent norms always use 1e-06"),
    ({"attention_scale": 0.25}, r"model.attention_scale=0.25"),
    ({"pattern": "*E*-"}, r"model.pattern='\*E\*-'"),
    ({"moe_shared_expert_ffn_hidden_size": 12}, "model.moe_shared_expert_ffn_hidden_size=12"),
    ({"sliding_window": 8}, "model.sliding_window=8"),
])
def test_unexpressible_config_names_the_blocking_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        deepseek_v3.config_to_hf(tiny_meshlm_config(**overrides))


def test_shipped_config_is_a_deepseek_v3():
    config = load_run_config(Path(__file__).resolve().parents[2] / "configs" / "deepseek-v3-tiny.yaml").model
    assert config.attention_type == "mla" and config.pattern.startswith("*-*E")
    assert choose_architecture(config).name == "DeepseekV3ForCausalLM"


def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


def test_mtp_layers_import_as_mtp_depths_and_export_as_the_hub_writes_them(tmp_path):
    """DeepSeek-V3's MTP layer L: h' = eh_proj([enorm(embedding); hnorm(hidden)]), then a decoder layer
    and shared_head.norm -- meshlm's depth 0, whose projection reads [hidden; embedding]."""
    torch.manual_seed(0)
    config = tiny_meshlm_config(mtp_depth=1, mtp_pattern="*E", init_std=0.2)
    model = LanguageModel(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.2)
    folder = tmp_path / "hf"
    save_model(model, tmp_path / "ours")
    _, chosen = meshlm_to_hf(tmp_path / "ours", folder)
    assert chosen.name == "DeepseekV3ForCausalLM"
    hub = {}
    for path in folder.glob("*.safetensors"):
        hub.update(load_file(path))
    mtp = "model.layers.2."  # after the two decoder layers
    assert {f"{mtp}{name}.weight" for name in ("eh_proj", "enorm", "hnorm", "shared_head.norm", "shared_head.head",
                                               "embed_tokens", "input_layernorm", "mlp.gate")} <= set(hub)
    assert torch.equal(hub[f"{mtp}embed_tokens.weight"], hub["model.embed_tokens.weight"])
    assert torch.equal(hub[f"{mtp}shared_head.head.weight"], hub["lm_head.weight"])
    hidden, embedded = torch.randn(2, 5, 32), torch.randn(2, 5, 32)
    depth = model.mtp.depths[0]
    with torch.no_grad():
        ours = depth.projection(torch.cat((depth.hidden_norm(hidden), depth.embedding_norm(embedded)), dim=-1))
        theirs = torch.nn.functional.linear(torch.cat((rms(embedded, hub[f"{mtp}enorm.weight"]),
                                                       rms(hidden, hub[f"{mtp}hnorm.weight"])), dim=-1),
                                            hub[f"{mtp}eh_proj.weight"])
    torch.testing.assert_close(ours, theirs)
    written = json.loads((folder / "config.json").read_text())
    assert written["num_nextn_predict_layers"] == 1
    back = load_model(hf_to_meshlm(folder, tmp_path / "back")[0])
    assert back.config == model.config
    assert all(torch.equal(back.state_dict()[name], tensor) for name, tensor in model.state_dict().items())
    # the imported depth drafts for self-speculative decoding, which keeps the greedy tokens
    assert meshlm.generate(back, PROMPT, max_new_tokens=6, greedy=True, speculative="mtp") == \
        meshlm.generate(model, PROMPT, max_new_tokens=6, greedy=True)


def test_a_folder_without_its_counted_mtp_layer_imports_without_mtp(tmp_path):
    """transformers writes no MTP layer, though its config.json keeps num_nextn_predict_layers: 1."""
    _, model = convert(tiny_deepseek_v3(num_nextn_predict_layers=1), tmp_path)
    assert model.config.mtp_depth == 0 and model.config.mtp_pattern == ModelConfig().mtp_pattern
