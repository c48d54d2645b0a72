"""FLOP accounting: every block kind's formula against torch's FlopCounterMode, forward and backward.

FlopCounterMode counts mm / bmm / SDPA by their shapes, per module. Two gaps in torch 2.13's
table are filled by ``tests/helpers/flop_formulas.py`` with the conventions torch uses elsewhere:
the CPU flash-attention kernels and ``_grouped_mm`` (the MoE experts' grouped GEMM). Latent
attention (MLA) is checked layer by layer, on both of its CPU paths (the flash kernel when value
heads are as wide as query/key heads, SDPA's math path -- two bmm -- when they are not), and
against its formulas written out from DeepSeek-V2's equations.
"""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from meshlm.errors import ConfigError
from meshlm.models.config import ModelConfig
from meshlm.models.flops import (BACKWARD_TO_FORWARD, adapter_parameters, block_flops, block_linear_layers,
                                 model_flops_breakdown, model_flops_per_sequence, model_flops_per_token)
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
    """A block's FLOPs as FlopCounterMode sees them: all but the Mamba conv's elementwise multiply-adds,
    and the zero-padded channels of latent attention's narrower value heads, which the kernel
    multiplies too (``padded_attend``)."""
    terms = block_flops(kind, config, seq_len).terms
    counted = sum(value for name, value in terms.items() if not (kind == "M" and name == "conv"))
    return counted + (padded_attend(config, terms) - terms["attend"] if kind == "*" else 0)


def padded_attend(config: ModelConfig, terms: dict) -> int:
    """The weighted sum's FLOPs as run: over value heads zero-padded to the query/key width where
    they are narrower (``attention.scaled_dot_product``; the model's count keeps their own width)."""
    key_width, value_width = config.resolved_head_dim, config.resolved_value_head_dim
    if value_width < key_width and config.attention_softcap is None:
        return terms["attend"] * key_width // value_width
    return terms["attend"]


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


MLA = dict(attention_type="mla", mla_kv_lora_rank=12, mla_qk_nope_head_dim=10, mla_qk_rope_head_dim=6)
"""Latent attention with every width different (h 32, 4 heads, r 12, d_n 10, d_r 6): a mixed-up
dimension changes a count."""


@pytest.mark.parametrize("q_rank,v_dim,window,seq_len", [(20, 16, None, 16), (None, 16, None, 24), (20, 8, None, 24),
                                                         (None, 14, None, 17), (20, 8, 6, 23), (None, 16, 8, 32),
                                                         (None, 20, None, 16)])
def test_latent_attention_block_matches_flop_counter_layer_by_layer(q_rank, v_dim, window, seq_len):
    config = make_config(pattern="*", **MLA, mla_q_lora_rank=q_rank, mla_v_head_dim=v_dim, sliding_window=window)
    counter = count_forward(config, seq_len)
    assert_blocks_match(config, seq_len, counter)
    terms = block_flops("*", config, seq_len).terms
    layers = block_linear_layers("*", config)
    expected = ["q_proj"] if q_rank is None else ["q_a_proj", "q_b_proj"]
    assert [name for name, _, _ in layers] == [*expected, "kv_a_proj", "kv_b_proj", "o_proj"]
    for name, _, _ in layers:  # each linear layer is its own term, under its own module's name
        assert module_flops(counter, f"LanguageModel.blocks.0.mixer.{name}") == terms[name] * BATCH, name
    by_op = counter.get_flop_counts()["LanguageModel.blocks.0.mixer"]
    core = by_op.get(aten._scaled_dot_product_flash_attention_for_cpu, 0) + by_op.get(aten.bmm, 0)
    # value heads as wide as the query/key heads (d_n + d_r = 16), or narrower and zero-padded to them,
    # take the flash kernel; wider ones the math path
    assert (aten.bmm in by_op) == (v_dim > 16)
    assert core == (terms["scores"] + padded_attend(config, terms)) * BATCH


def test_latent_attention_formulas_from_deepseek_v2():
    """DeepSeek-V2 §2.1, for T tokens: c_q = x W_DQ (h -> r_q), q = c_q W_UQ (r_q -> a(d_n + d_r));
    [c_kv, k_r] = x W_DKV (h -> r + d_r), [k_n, v] = c_kv W_UKV (r -> a(d_n + d_v)); o = W_O (a d_v -> h);
    scores q.k over a(d_n + d_r) channels, weighted sum over a d_v, per query-key pair."""
    h, a, r_q, r, d_n, d_r, d_v, T = 32, 4, 20, 12, 10, 6, 8, 24
    config = make_config(pattern="*", **MLA, mla_q_lora_rank=r_q, mla_v_head_dim=d_v)
    assert block_flops("*", config, T).terms == {
        "q_a_proj": 2 * T * h * r_q, "q_b_proj": 2 * T * r_q * a * (d_n + d_r),
        "kv_a_proj": 2 * T * h * (r + d_r), "kv_b_proj": 2 * T * r * a * (d_n + d_v),
        "scores": 2 * a * T * T * (d_n + d_r), "attend": 2 * a * T * T * d_v, "o_proj": 2 * T * a * d_v * h}
    # the layers' (in, out) are the module's own, and LoRA adapters count r (in + out) on each
    model = LanguageModel(make_config(pattern="*", **MLA, mla_q_lora_rank=r_q, mla_v_head_dim=d_v, lora_rank=2,
                                      lora_targets=["q_a_proj", "q_b_proj", "kv_a_proj", "kv_b_proj", "o_proj"]))
    mixer = model.blocks[0].mixer
    for name, in_features, out_features in block_linear_layers("*", model.config):
        assert (getattr(mixer, name).in_features, getattr(mixer, name).out_features) == (in_features, out_features)
    adapters = sum(param.numel() for name, param in model.named_parameters() if ".lora." in name)
    assert adapter_parameters(model.config) == adapters == 2 * (h + r_q + r_q + a * (d_n + d_r) + h + r + d_r
                                                              + r + a * (d_n + d_v) + a * d_v + h)


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
    "moe_mtp_tied": dict(pattern="*E|ME", moe_latent_size=16, moe_shared_expert_ffn_hidden_size=24,
                         moe_shared_expert_gate=True, mtp_depth=2, mtp_pattern="*E", tie_embeddings=True),
    "mla_moe_mtp": dict(pattern="*-*E", **MLA, mla_q_lora_rank=20, mla_v_head_dim=8, mtp_depth=2, mtp_pattern="*-"),
}


@pytest.mark.parametrize("name", sorted(WHOLE_MODELS))
def test_whole_model_forward_matches_flop_counter(name):
    config, seq_len = make_config(**WHOLE_MODELS[name]), 30
    counter = count_forward(config, seq_len, with_labels=True)
    assert_blocks_match(config, seq_len, counter)
    expected = model_flops_per_sequence(config, seq_len, include_backward=False) * BATCH
    padding = padded_value_flops(config, seq_len)  # per attention block
    kinds = list(config.block_kinds) + list(config.mtp_pattern) * config.mtp_depth
    assert counter.get_total_flops() == expected - mamba_conv_flops(config, seq_len) * BATCH + \
        kinds.count("*") * padding * BATCH
    per_token = model_flops_per_token(config, seq_len, include_backward=False)
    assert per_token * seq_len * BATCH == pytest.approx(expected, rel=1e-12)
    if config.mtp_depth:  # a depth's own modules, plus its pass through the shared head
        parts = model_flops_breakdown(config, seq_len)
        assert module_flops(counter, "LanguageModel.mtp.depths.1") == (
            parts["mtp.1"] - parts["head"] + config.mtp_pattern.count("*") * padding) * BATCH


def padded_value_flops(config: ModelConfig, seq_len: int) -> int:
    """What one attention block's zero-padded value channels add to the FLOPs as run (``padded_attend``)."""
    terms = block_flops("*", config, seq_len).terms
    return padded_attend(config, terms) - terms["attend"]


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


def test_latent_attention_model_is_6n_plus_its_attention_term():
    """6N per token for N matmul weights (Kaplan et al. 2020), plus for each block, per token, scores
    and weighted sum 2 a T (d_n + d_r) + 2 a T d_v forward, three times that for training."""
    config, seq_len = make_config(pattern="*-*-", **MLA, mla_q_lora_rank=20, mla_v_head_dim=8), 40
    model = LanguageModel(config)
    matmul_weights = sum(module.weight.numel() for module in model.modules() if isinstance(module, torch.nn.Linear))
    attention = 2 * 4 * seq_len * (10 + 6) + 2 * 4 * seq_len * 8
    assert model_flops_per_token(config, seq_len) == 6 * matmul_weights + 3 * 2 * attention


def test_latent_attention_forward_and_backward_match_flop_counter():
    """On SDPA's math path (value heads wider than the query/key heads, d_v > d_n + d_r) nothing is
    recomputed: the backward is exactly twice the forward."""
    config, seq_len = make_config(pattern="*-", **MLA, mla_q_lora_rank=20, mla_v_head_dim=20), 24
    torch.manual_seed(0)
    model = LanguageModel(config)
    input_ids = torch.randint(0, config.vocab_size, (BATCH, seq_len))
    with flop_counter() as counter:
        model(input_ids, labels=input_ids).loss.backward()
    assert counter.get_total_flops() == model_flops_per_sequence(config, seq_len) * BATCH


def test_bad_block_kind_or_length_raises_config_error():
    config = make_config(pattern="*")
    with pytest.raises(ConfigError, match="block kind"):
        block_flops("x", config, 16)
    with pytest.raises(ConfigError, match="seq_len"):
        block_flops("*", config, 0)
