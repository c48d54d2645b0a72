import pytest

from meshlm.errors import ConfigError
from meshlm.models.config import ModelConfig
from meshlm.models.pattern import parse_pattern


def test_pattern_parses_kinds_and_stage_boundaries():
    parsed = parse_pattern("M-M*|-M-E")
    assert parsed.kinds == ("M", "-", "M", "*", "-", "M", "-", "E")
    assert parsed.stage_starts == (0, 4)
    assert parse_pattern("*- *-").kinds == ("*", "-", "*", "-")


@pytest.mark.parametrize("pattern, fragment", [
    ("*x-", "unknown symbol 'x' at position 1"),
    ("|*-", "empty"),
    ("*||-", "empty"),
    ("*-|", "empty last stage"),
    ("", "no blocks"),
])
def test_bad_patterns_name_the_problem(pattern, fragment):
    with pytest.raises(ConfigError, match="model.pattern") as error:
        ModelConfig(pattern=pattern)
    assert fragment in str(error.value)


def test_defaults_are_resolved_in_one_place():
    config = ModelConfig(hidden_size=96, num_attention_heads=6, mlp_activation="swiglu", pattern="*-M")
    assert config.resolved_head_dim == 16
    assert config.resolved_num_kv_heads == 6
    assert config.resolved_ffn_hidden_size == 256  # 8/3 * 96 = 256 (already a multiple of 64)
    assert ModelConfig(hidden_size=96, num_attention_heads=6, mlp_activation="squared_relu").resolved_ffn_hidden_size == 384
    assert config.resolved_mamba_num_heads == 2 * 96 // 16
    assert config.num_blocks == 3
    assert config.output_init_std == pytest.approx(0.02 / (2 * 3) ** 0.5)


@pytest.mark.parametrize("overrides, fragment", [
    (dict(num_attention_heads=4, num_kv_heads=3), "model.num_kv_heads=3"),
    (dict(hidden_size=30, num_attention_heads=4), "model.hidden_size=30"),
    (dict(mlp_activation="tanh"), "model.mlp_activation='tanh'"),
    (dict(norm="batchnorm"), "model.norm='batchnorm'"),
    (dict(pattern="E", moe_num_experts=2, moe_top_k=3), "model.moe_top_k=3"),
    (dict(pattern="E", moe_capacity_factor=0.0), "model.moe_capacity_factor=0.0"),
    (dict(pattern="M", mamba_num_groups=3, mamba_num_heads=8), "model.mamba_num_groups=3"),
    (dict(vocab_size=0), "model.vocab_size=0"),
    (dict(hidden_size="64"), "model.hidden_size='64'"),
    (dict(head_dim=7, position_embedding="rope", num_attention_heads=2, hidden_size=14), "head dim (7)"),
    (dict(qk_norm_type="layernorm"), "model.qk_norm_type='layernorm' shapes the QK-norm, and model.qk_norm is false"),
    (dict(qk_norm_per_head=True), "model.qk_norm_per_head=True shapes the QK-norm"),
    (dict(qk_norm=True, qk_norm_type="groupnorm"), "model.qk_norm_type='groupnorm'"),
    (dict(qk_norm=True, qk_norm_bias=True), "model.qk_norm_type='rmsnorm' has none"),
    (dict(qk_norm=True, qk_norm_scope="all", qk_norm_per_head=True), "model.qk_norm_per_head=true is for a norm"),
    (dict(qk_norm=True, qk_norm_scope="all", qk_norm_type="layernorm"), "set model.qk_norm_scope=head"),
    (dict(qk_norm=True, qk_norm_type="layernorm", norm_zero_centered=True), "model.qk_norm_type=layernorm has a"),
    (dict(pattern="M-", rope_pattern="N"), "model.pattern='M-' has none; drop model.rope_pattern"),
])
def test_invalid_fields_are_named(overrides, fragment):
    with pytest.raises(ConfigError) as error:
        ModelConfig(**overrides)
    assert fragment in str(error.value)


def test_fields_of_absent_block_kinds_are_not_checked():
    # Attention-only constraints do not block a pure Mamba model.
    ModelConfig(pattern="MM", hidden_size=40, num_attention_heads=3)


def test_round_trip_and_unknown_keys_get_suggestions():
    config = ModelConfig(pattern="M*E-", moe_top_k=1, qk_norm=True)
    assert ModelConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ConfigError, match="hiden_size.*did you mean hidden_size"):
        ModelConfig.from_dict({"hiden_size": 32})
