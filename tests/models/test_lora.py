"""LoRA adapters (meshlm/models/lora.py): where they sit, what trains, the merge, the FLOPs, and
the dropout on their inputs."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from meshlm.errors import ConfigError
from meshlm.models.config import LORA_DEFAULT_TARGETS, ModelConfig
from meshlm.models.flops import BACKWARD_TO_FORWARD, adapter_flops, adapter_parameters, model_flops_per_sequence
from meshlm.models.fused_linear import project_together
from meshlm.models.language_model import LanguageModel
from meshlm.models.lora import AdaptedLinear, LowRankAdapter, merged_state, without_adapters

HYBRID = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_kv_heads=2, pattern="M*-E",
              mamba_head_dim=8, mamba_state_size=8, mamba_chunk_size=8, moe_num_experts=4, moe_top_k=2,
              moe_ffn_hidden_size=16, moe_shared_expert_ffn_hidden_size=16, mtp_depth=1)


def lora_model(seed: int = 0, **overrides) -> LanguageModel:
    config = ModelConfig(**{**HYBRID, "lora_rank": 4, "lora_alpha": 8, **overrides})
    return LanguageModel(config, seed=seed)


def trained_adapters(model: LanguageModel) -> LanguageModel:
    """``model`` with every adapter's b drawn at random (a fresh b is zero: the detour would be nothing)."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(".lora.b"):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return model


def test_fresh_adapters_leave_the_model_unchanged_and_only_they_train():
    base = LanguageModel(ModelConfig(**HYBRID), seed=0)
    model = lora_model()
    state = model.state_dict()
    adapters = sorted(name for name in state if ".lora." in name)
    assert all(torch.equal(state[name], value) for name, value in base.state_dict().items())
    layers = {name.rsplit(".lora.", 1)[0].rsplit(".", 1)[-1] for name in adapters}
    assert layers == set(LORA_DEFAULT_TARGETS)  # Mamba in/out, attention q/k/v/o, MLP and shared expert
    assert any(name.startswith("mtp.depths.0.blocks.") for name in adapters)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(model(ids, labels=ids).loss, base(ids, labels=ids).loss)
    model(ids, labels=ids).loss.backward()
    trained = {name for name, parameter in model.named_parameters() if parameter.grad is not None}
    assert trained == set(adapters)
    assert all(not parameter.requires_grad for name, parameter in model.named_parameters() if ".lora." not in name)
    a = state["blocks.1.mixer.q_proj.lora.a"]  # nn.Linear's default init: U(+-1/sqrt(in))
    assert a.abs().max() <= 1 / math.sqrt(32) and a.std() > 0.5 / math.sqrt(3 * 32)


def test_the_detour_is_scale_b_a_and_merging_folds_it_into_the_weight():
    model = trained_adapters(lora_model()).eval()
    layer = model.blocks[1].mixer.q_proj
    assert isinstance(layer, AdaptedLinear) and layer.lora.scale == 2.0  # lora_alpha / lora_rank
    x = torch.randn(3, 32)
    expected = x @ (layer.weight + 2.0 * layer.lora.b @ layer.lora.a).T
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-6)
    config, state = merged_state(model.config, model.state_dict())
    assert config.lora_rank == 0 and config == without_adapters(model.config)
    assert not any(".lora." in name for name in state)
    merged = LanguageModel(config, seed=5)
    merged.load_state_dict(state)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(merged.eval()(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-5)


def test_fused_projections_add_each_adapter_to_its_own_output():
    model = trained_adapters(lora_model())
    attention = model.blocks[1].mixer
    x = torch.randn(2, 5, 32, requires_grad=True)
    layers = (attention.q_proj, attention.k_proj, attention.v_proj)
    together = project_together(x, layers)  # one GEMM for the frozen weights
    for out, layer in zip(together, layers):
        torch.testing.assert_close(out, layer(x), rtol=1e-5, atol=1e-6)
    sum(out.square().sum() for out in together).backward()
    assert attention.q_proj.lora.a.grad is not None and attention.q_proj.weight.grad is None


def test_targets_choose_the_layers_and_a_target_the_model_lacks_is_refused():
    model = lora_model(lora_targets=["q_proj", "v_proj"])
    adapted = sorted(name for name, module in model.named_modules() if isinstance(module, LowRankAdapter))
    assert adapted == ["blocks.1.mixer.q_proj.lora", "blocks.1.mixer.v_proj.lora",
                       "mtp.depths.0.blocks.0.mixer.q_proj.lora", "mtp.depths.0.blocks.0.mixer.v_proj.lora"]
    assert type(model.blocks[1].mixer.k_proj) is nn.Linear
    dense = ModelConfig(vocab_size=64, hidden_size=32, pattern="*-", lora_rank=2)  # default list: what it has
    assert {name.split(".")[-3] for name, _ in LanguageModel(dense, seed=0).named_parameters() if ".lora." in name} \
        == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    with pytest.raises(ConfigError, match=r"model.lora_targets names \['in_proj'\], which no block"):
        LanguageModel(ModelConfig(vocab_size=64, hidden_size=32, pattern="*-", lora_rank=2,
                                  lora_targets=["q_proj", "in_proj"]), seed=0)


@pytest.mark.parametrize("field, value, words", [
    ("lora_rank", -1, "must be an integer >= 0"),
    ("lora_rank", 2.5, "must be an integer >= 0"),
    ("lora_alpha", 0, "must be a positive number"),
    ("lora_targets", "q_proj", "must be a non-empty list"),
    ("lora_targets", [], "must be a non-empty list"),
    ("lora_targets", ["query"], "not linear layers of the blocks"),
    ("lora_dropout", 1.0, "must be a probability in"),
    ("lora_dropout", -0.1, "must be a probability in"),
])
def test_bad_lora_fields_are_refused_by_name(field, value, words):
    with pytest.raises(ConfigError, match=f"model.{field}=.*{words}|model.{field} names .*{words}"):
        ModelConfig(**{"lora_rank": 4, field: value})


def test_a_reward_model_trains_its_new_head_with_the_adapters():
    model = LanguageModel(ModelConfig(vocab_size=64, hidden_size=32, pattern="*-", head="reward", lora_rank=2), seed=0)
    trained = {name for name, parameter in model.named_parameters() if parameter.requires_grad}
    assert "reward_head.weight" in trained and all(".lora." in name for name in trained - {"reward_head.weight"})


def test_adapter_flops_and_the_training_step_without_frozen_weight_gradients():
    model = lora_model()
    config, seq_len = model.config, 16
    adapters = sum(parameter.numel() for name, parameter in model.named_parameters() if ".lora." in name)
    assert adapter_parameters(config) == adapters
    assert adapter_flops(config, seq_len) == 2 * adapters * seq_len  # one multiply-add per parameter and token
    base = without_adapters(config)
    forward = model_flops_per_sequence(base, seq_len, include_backward=False)
    assert model_flops_per_sequence(config, seq_len, include_backward=False) == forward + adapter_flops(config, seq_len)
    dense = ModelConfig(vocab_size=64, hidden_size=32, pattern="*-", lora_rank=2)  # attention's are the only
    # matmuls between two activations
    weights = model_flops_per_sequence(without_adapters(dense), seq_len, include_backward=False)
    attention = 2 * 2 * 4 * seq_len * seq_len * 8  # scores and weighted sum: 4 heads of 8
    assert model_flops_per_sequence(dense, seq_len) == (2 * weights + attention
                                                        + (1 + BACKWARD_TO_FORWARD) * adapter_flops(dense, seq_len))


# --- dropout on the adapters' inputs (model.lora_dropout) -------------------------------------------


def adapter_with_dropout(p: float = 0.3, site: int = 7) -> LowRankAdapter:
    adapter = LowRankAdapter(16, 12, 4, 2.0, dropout=p, site=site)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        adapter.a.copy_(torch.randn(adapter.a.shape, generator=generator))
        adapter.b.copy_(torch.randn(adapter.b.shape, generator=generator))
    return adapter


def coordinates_of(batch: int, seq: int, step: int = 0, first_sample: int = 0):
    from meshlm.models.context import SequenceContext
    from meshlm.models.dropout import DropoutKey, TokenCoordinates

    key = DropoutKey(seed=5, step=step, sample_ids=torch.arange(first_sample, first_sample + batch))
    return TokenCoordinates.of(SequenceContext.for_tokens(torch.zeros(batch, seq, dtype=torch.long), dropout_key=key))


def test_dropout_scales_the_kept_inputs_and_drops_about_p_of_them():
    """With a = b = I the detour is what the adapter read: about p of the elements zeroed, the rest
    x / (1 - p); the gradient flows through the kept ones only."""
    adapter = LowRankAdapter(16, 16, 16, 1.0, dropout=0.3, site=7)
    with torch.no_grad():
        adapter.a.copy_(torch.eye(16))
        adapter.b.copy_(torch.eye(16))
    x = (torch.rand(4, 64, 16) + 1.0).requires_grad_()  # no zeros of its own
    read = adapter(x, coordinates=coordinates_of(4, 64))
    kept = read != 0
    assert abs(1 - kept.float().mean().item() - 0.3) < 0.03  # 4096 elements
    torch.testing.assert_close(read[kept], (x / 0.7)[kept], rtol=1e-6, atol=0)
    read.sum().backward()
    torch.testing.assert_close(x.grad, kept.float() / 0.7, rtol=1e-6, atol=0)


def test_dropout_keys_on_coordinates_so_slices_shards_and_flattening_agree():
    """A token's mask depends on its sample, position and channel only: a slice of the sequence,
    the tokens flattened (an MoE layer's order) and a row-parallel shard's channels (two partitions,
    as Mamba's split input) all drop what the whole drops."""
    adapter = adapter_with_dropout()
    x, coordinates = torch.randn(2, 10, 16), coordinates_of(2, 10)
    whole = adapter(x, coordinates=coordinates)
    sliced = coordinates_of(2, 10)
    sliced.rows, sliced.positions = sliced.rows[:, 3:7], sliced.positions[:, 3:7]
    torch.testing.assert_close(adapter(x[:, 3:7], coordinates=sliced), whole[:, 3:7], rtol=0, atol=1e-6)
    flat = adapter(x.reshape(20, 16), coordinates=coordinates.flattened())
    torch.testing.assert_close(flat, whole.reshape(20, 12), rtol=0, atol=1e-6)
    shards = [torch.cat((torch.arange(0, 4), torch.arange(8, 12))),
              torch.cat((torch.arange(4, 8), torch.arange(12, 16)))]
    summed = 0
    for channels in shards:
        shard = LowRankAdapter(8, 12, 4, 2.0, dropout=0.3, site=7)
        with torch.no_grad():
            shard.a.copy_(adapter.a[:, channels])
            shard.b.copy_(adapter.b)
        shard.input_channels = channels
        summed = summed + shard(x[..., channels], coordinates=coordinates)
    torch.testing.assert_close(summed, whole, rtol=1e-5, atol=1e-5)


def test_each_site_step_and_sample_draws_its_own_mask_and_evaluation_none():
    adapter, x = adapter_with_dropout(), torch.randn(2, 10, 16)
    base = adapter(x, coordinates=coordinates_of(2, 10))
    other_site = adapter_with_dropout(site=8)(x, coordinates=coordinates_of(2, 10))
    other_step = adapter(x, coordinates=coordinates_of(2, 10, step=1))
    other_samples = adapter(x, coordinates=coordinates_of(2, 10, first_sample=2))
    for different in (other_site, other_step, other_samples):
        assert not torch.allclose(different, base)
    with pytest.raises(RuntimeError, match="model.lora_dropout needs the tokens' coordinates"):
        adapter(x)
    adapter.eval()
    plain = LowRankAdapter(16, 12, 4, 2.0)
    plain.load_state_dict(adapter.state_dict())
    torch.testing.assert_close(adapter(x), plain(x), rtol=0, atol=0)


def test_a_model_with_lora_dropout_trains_differently_and_evaluates_alike():
    """Every adapter of the hybrid (Mamba in/out, attention q/k/v/o, MLP and shared expert, the MTP
    depth's) drops its inputs in training; q's, k's and v's masks differ (sites of their own);
    evaluation is the model without dropout."""
    from meshlm.models.dropout import DropoutKey

    dropping = trained_adapters(lora_model(lora_dropout=0.2))
    plain = lora_model()
    plain.load_state_dict(dropping.state_dict())
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    key = DropoutKey(seed=1, step=0, sample_ids=torch.arange(2))
    first = dropping(ids, ids, dropout_key=key).loss
    assert first.item() != plain(ids, ids, dropout_key=key).loss.item()
    assert dropping(ids, ids, dropout_key=key).loss.item() == first.item()  # the same key, the same masks
    first.backward()
    assert all(parameter.grad is not None for name, parameter in dropping.named_parameters() if ".lora." in name)
    sites = {module.site for module in dropping.modules() if isinstance(module, LowRankAdapter)}
    assert len(sites) == sum(isinstance(module, LowRankAdapter) for module in dropping.modules())
    dropping.eval(), plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(dropping(ids).logits, plain(ids).logits, rtol=0, atol=0)
    with pytest.raises(ConfigError, match="model.lora_dropout=0.1 drops an adapter's inputs, and model.lora_rank=0"):
        ModelConfig(lora_dropout=0.1)
    with pytest.raises(ConfigError, match="not built for the LatentMoE projections"):
        ModelConfig(lora_rank=4, lora_dropout=0.1, lora_targets=["q_proj", "latent_in_proj"])
