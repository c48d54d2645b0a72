"""FLOP accounting: every block kind's formula against torch's FlopCounterMode, forward and backward.

FlopCounterMode counts mm / bmm / SDPA by their shapes, per module. Two gaps in torch 2.13's
table are filled by ``tests/helpers/flop_formulas.py`` with the conventions torch uses elsewhere:
the CPU flash-attention kernels and ``_grouped_mm`` (the MoE experts' grouped GEMM).
"""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from meshlm.errors import ConfigError
from meshlm.models.config import ModelConfig
from meshlm.models.flops import (BACKWARD_TO_FORWARD, block_flops, model_flops_breakdown, model_flops_per_sequence,
                                 model_flops_per_token)
from meshlm.models.language_model import LanguageModel
from meshlm.models.moe.layer import MoELayer
from tests.helpers.flop_formulas import MISSING_FORMULAS

aten = torch.ops.aten
BATCH = 2


def flop_counter() -> FlopCounterMode:
    return FlopCounterMode(display=False, custom_mapping=MISSING_FORMULAS)


def module_flops(counter: FlopCounterMode, name: str) -> int:
    return sum(counter.get_flop_counts().get(name, {}).values())


def make_config(**overrides) -> ModelConfig:
    values = dict(vocab_size=96, hidden_size=32, num_attention_heads=4, mamba_head_dim=8, mamba_state_size=8,
                  mamba_chunk_size=8, moe_num_experts=4, moe_top_k=2, moe_ffn_hidden_size=48)
    values.update(overrides)
    return ModelConfig(**values)


def count_forward(config: ModelConfig, seq_len: int, with_labels: bool = False):
    torch.manual_seed(0)
    model = LanguageModel(config)
    input_ids = torch.randint(0, config.vocab_size, (BATCH, seq_len))
    with flop_counter() as counter:
        model(input_ids, labels=input_ids if with_labels else None)
    return counter


def counted_flops(kind: str, config: ModelConfig, seq_len: int) -> int:
    """A block's FLOPs as FlopCounterMode sees them: all but the Mamba conv's elementwise multiply-adds."""
    terms = block_flops(kind, config, seq_len).terms
    return sum(value for name, value in terms.items() if not (kind == "M" and name == "conv"))


def assert_blocks_match(config: ModelConfig, seq_len: int, counter: FlopCounterMode) -> None:
    for index, kind in enumerate(config.block_kinds):
        expected = counted_flops(kind, config, seq_len) * BATCH
        assert module_flops(counter, f"LanguageModel.blocks.{index}") == expected, (index, kind)


# --- one block kind at a time ------------------------------------------------------------------------
@pytest.mark.parametrize("num_kv_heads,seq_len", [(4, 16), (2, 33), (1, 24)])
def test_attention_block_matches_flop_counter(num_kv_heads, seq_len):
    config = make_config(pattern="*", num_kv_heads=num_kv_heads)
    counter = count_forward(config, seq_len)
    assert_blocks_match(config, seq_len, counter)
    terms = block_flops("*", config, seq_len).terms
    by_op = counter.get_flop_counts()["LanguageModel.blocks.0.mixer"]
    # q, k and v in one GEMM (meshlm/models/fused_linear.py), then o_proj
    assert by_op[aten.mm] == (terms["q_proj"] + terms["kv_proj"] + terms["o_proj"]) * BATCH
    assert module_flops(counter, "LanguageModel.blocks.0.mixer.o_proj") == terms["o_proj"] * BATCH
    sdpa = by_op[aten._scaled_dot_product_flash_attention_for_cpu]
    assert sdpa == (terms["scores"] + terms["attend"]) * BATCH  # the full square, as torch counts it


@pytest.mark.parametrize("activation,num_projections", [("swiglu", 3), ("squared_relu", 2), ("gelu", 2)])
def test_mlp_block_matches_flop_counter(activation, num_projections):
    config = make_config(pattern="-", mlp_activation=activation, ffn_hidden_size=40)
    counter = count_forward(config, seq_len=20)
    assert_blocks_match(config, 20, counter)
    assert block_flops("-", config, 20).per_sequence == num_projections * 2 * 32 * 40 * 20


@pytest.mark.parametrize("seq_len,chunk_size,groups", [(32, 8, 1), (30, 12, 2), (16, 64, 2), (17, 4, 1)])
def test_mamba_block_matches_flop_counter_term_by_term(seq_len, chunk_size, groups):
    config = make_config(pattern="M", mamba_chunk_size=chunk_size, mamba_num_groups=groups)
    counter = count_forward(config, seq_len)
    assert_blocks_match(config, seq_len, counter)
    terms = block_flops("M", config, seq_len).terms
    by_op = counter.get_flop_counts()["LanguageModel.blocks.0.mixer"]
    assert by_op[aten.mm] == (terms["in_proj"] + terms["out_proj"]) * BATCH
    assert aten.convolution not in by_op  # K shifted multiply-adds: 2 per channel, tap and token
    assert terms["conv"] == 2 * (config.mamba_inner_size + 2 * groups * 8) * config.mamba_conv_kernel * seq_len
    ssd = sum(value for name, value in terms.items() if name.startswith("ssd_"))
    assert by_op[aten.bmm] == ssd * BATCH  # the five SSD einsums, padded last chunk included


@pytest.mark.parametrize("latent,shared,grouped_kernel", [(None, 0, False), (16, 24, False), (16, 24, True),
                                                          (None, 40, True)])
def test_moe_block_matches_flop_counter(latent, shared, grouped_kernel):
    config = make_config(pattern="E", moe_latent_size=latent, moe_shared_expert_ffn_hidden_size=shared)
    torch.manual_seed(0)
    model = LanguageModel(config)
    model.blocks[0].mixer.experts.use_grouped_mm = grouped_kernel
    input_ids = torch.randint(0, config.vocab_size, (BATCH, 24))
    with flop_counter() as counter:
        output = model(input_ids)
    assert int(output.tokens_per_expert[0].sum()) == BATCH * 24 * config.moe_top_k  # dropless: k visits each
    assert_blocks_match(config, 24, counter)


def test_moe_with_capacity_counts_the_nominal_top_k_and_torch_counts_what_is_kept():
    config = make_config(pattern="E", moe_capacity_factor=0.5, moe_shared_expert_ffn_hidden_size=24)
    torch.manual_seed(0)
    layer = MoELayer(config)
    hidden = torch.randn(BATCH, 24, config.hidden_size)
    with flop_counter() as counter:
        _, losses = layer(hidden)
    dropped = int(losses.dropped_tokens)
    assert dropped > 0
    per_visit = block_flops("E", config, seq_len=1).terms["experts"] // config.moe_top_k
    nominal = block_flops("E", config, seq_len=24).per_sequence * BATCH
    assert counter.get_total_flops() == nominal - dropped * per_visit


# --- whole models ---------------------------------------------------------------------------------------
WHOLE_MODELS = {
    "dense": dict(pattern="*-*-", num_kv_heads=2),
    "hybrid": dict(pattern="M-M*-", mamba_chunk_size=12, mamba_num_groups=2, mlp_activation="squared_relu"),
    "moe_mtp_tied": dict(pattern="*E|ME", moe_latent_size=16, moe_shared_expert_ffn_hidden_size=24, mtp_depth=2,
                         mtp_pattern="*E", tie_embeddings=True),
}


@pytest.mark.parametrize("name", sorted(WHOLE_MODELS))
def test_whole_model_forward_matches_flop_counter(name):
    config, seq_len = make_config(**WHOLE_MODELS[name]), 30
    counter = count_forward(config, seq_len, with_labels=True)
    assert_blocks_match(config, seq_len, counter)
    expected = model_flops_per_sequence(config, seq_len, include_backward=False) * BATCH
    assert counter.get_total_flops() == expected - mamba_conv_flops(config, seq_len) * BATCH
    per_token = model_flops_per_token(config, seq_len, include_backward=False)
    assert per_token * seq_len * BATCH == pytest.approx(expected, rel=1e-12)
    if config.mtp_depth:  # a depth's own modules, plus its pass through the shared head
        parts = model_flops_breakdown(config, seq_len)
        assert module_flops(counter, "LanguageModel.mtp.depths.1") == (parts["mtp.1"] - parts["head"]) * BATCH


def mamba_conv_flops(config: ModelConfig, seq_len: int) -> int:
    """The conv FLOPs of all Mamba blocks (main and MTP) for one sequence: elementwise, so uncounted."""
    kinds = list(config.block_kinds) + list(config.mtp_pattern) * config.mtp_depth
    return kinds.count("M") * block_flops("M", config, seq_len).terms["conv"]


def test_forward_and_backward_match_flop_counter_up_to_recompute():
    config, seq_len = make_config(pattern="M*E-", mamba_chunk_size=12, moe_shared_expert_ffn_hidden_size=24,
                                  mtp_depth=1), 30
    torch.manual_seed(0)
    model = LanguageModel(config)
    input_ids = torch.randint(0, config.vocab_size, (BATCH, seq_len))
    with flop_counter() as counter:
        model(input_ids, labels=input_ids).loss.backward()
    # The differences: a fused attention backward recomputes the scores Q K^T (hardware FLOPs,
    # Korthikanti et al. 2022), which model FLOPs leave out (one attention block in the model, one
    # in MTP); the SSD backward recomputes its scores C B^T and state outputs C H^T and differentiates
    # the inter-chunk recurrence with one matmul instead of two; the conv is elementwise (uncounted).
    recomputed_scores = 2 * block_flops("*", config, seq_len).terms["scores"] * BATCH
    ssd = block_flops("M", config, seq_len).terms
    ssd_difference = (ssd["ssd_scores"] + ssd["ssd_state_output"] - ssd["ssd_state_passing"]) * BATCH
    expected = model_flops_per_sequence(config, seq_len, include_backward=True) * BATCH
    assert counter.get_total_flops() == (expected + recomputed_scores + ssd_difference
                                         - (1 + BACKWARD_TO_FORWARD) * mamba_conv_flops(config, seq_len) * BATCH)
    forward_only = model_flops_per_sequence(config, seq_len, include_backward=False)
    assert model_flops_per_sequence(config, seq_len) == (1 + BACKWARD_TO_FORWARD) * forward_only


# --- against the textbook formulas ------------------------------------------------------------------------
def test_dense_model_is_6n_plus_palm_attention_term():
    """Kaplan et al. 2020: 6N per token for N matmul weights; PaLM adds 12 L H Q T for attention."""
    config, seq_len = make_config(pattern="*-*-*-", num_kv_heads=2, attention_bias=True), 40
    model = LanguageModel(config)
    matmul_weights = sum(module.weight.numel() for module in model.modules() if isinstance(module, torch.nn.Linear))
    num_attention_blocks, heads, head_dim = 3, config.num_attention_heads, config.resolved_head_dim
    expected = 6 * matmul_weights + 12 * num_attention_blocks * heads * head_dim * seq_len
    assert model_flops_per_token(config, seq_len) == expected


def test_bad_block_kind_or_length_raises_config_error():
    config = make_config(pattern="*")
    with pytest.raises(ConfigError, match="block kind"):
        block_flops("x", config, 16)
    with pytest.raises(ConfigError, match="seq_len"):
        block_flops("*", config, 0)
