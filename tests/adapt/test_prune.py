"""Minitron pruning (``meshlm/adapt/prune.py``, ``importance.py``): the scores rank units as their
activations do, exactly the top units survive (GQA groups and Mamba groups kept whole, latent
attention heads cut alone with the latents kept), pruning to
the same shape changes nothing, depth pruning drops the block that matters least, a parameter
budget is met, and impossible sizes are refused naming the flag."""

from __future__ import annotations

import pytest
import torch

from meshlm.adapt.importance import Importance, collect_importance
from meshlm.adapt.prune import ParameterCounter, original_widths, prune_model, resolve_widths, search_widths
from meshlm.adapt.prune_blocks import per_block_sizes
from meshlm.errors import ConfigError
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel

HYBRID = dict(vocab_size=64, hidden_size=32, pattern="M*-E|L-", num_attention_heads=4, num_kv_heads=2,
              mamba_head_dim=8, mamba_num_groups=2, mamba_state_size=8, mamba_chunk_size=8, moe_num_experts=4,
              moe_shared_expert_ffn_hidden_size=16, moe_shared_expert_gate=True, qk_norm=True)


def model_of(**values) -> LanguageModel:
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(**values))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "_proj" in name:
                param.normal_(std=0.2)
    return model.eval()


def batches(count=2, batch=2, seq=16):
    generator = torch.Generator().manual_seed(1)
    for _ in range(count):
        ids = torch.randint(0, 64, (batch, seq), generator=generator)
        yield {"input_ids": ids, "labels": torch.roll(ids, -1, dims=1)}


def tokens():
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))


def test_pruning_to_the_same_shape_gives_the_same_model():
    model = model_of(**HYBRID)
    importance = collect_importance(model, batches())
    pruned = prune_model(model, importance, original_widths(model.config))
    for name, value in model.state_dict().items():
        assert torch.equal(pruned.state_dict()[name], value), name
    with torch.no_grad():
        assert torch.equal(pruned(tokens()).logits, model(tokens()).logits)


def test_scores_follow_hand_set_activation_scales_and_the_top_units_survive():
    """Scaling unit k's weights by c_k scales its activation by c_k (or c_k^2), so the scores'
    order is the c order; the pruned weights are the original rows of exactly the top units."""
    model = model_of(vocab_size=64, hidden_size=16, pattern="*-M", num_attention_heads=4, ffn_hidden_size=8,
                     mlp_activation="squared_relu", mamba_head_dim=4, mamba_num_heads=4, mamba_state_size=4,
                     mamba_chunk_size=8)
    attention, mlp, mamba = (block.mixer for block in model.blocks)
    hidden_scale = torch.tensor([3., 1, 4, 1.5, 5, 9, 2, 6, 0.5, 3.5, 8, 9.5, 7, 0.25, 2.5, 4.5])
    neuron_scale = torch.tensor([0.5, 3, 1, 4, 2, 0.25, 5, 1.5])
    head_scale = torch.tensor([1.0, 3.0, 0.5, 2.0])
    mamba_scale = torch.tensor([2.0, 0.5, 3.0, 1.0])
    with torch.no_grad():
        # every channel of the stream is +-1 and stays so (the mixers write nothing into it, though
        # their inner activations are untouched), so each norm's output channel i is +-w_i
        model.embedding.weight.copy_(model.embedding.weight.sign())
        for projection in (attention.o_proj, mlp.down_proj, mamba.out_proj):
            projection.weight.zero_()
        for norm in [block.norm for block in model.blocks] + [model.final_norm]:
            norm.weight.copy_(hidden_scale)
        mlp.up_proj.weight.copy_(mlp.up_proj.weight[:1] * neuron_scale[:, None])   # one row, scaled per neuron
        attention.v_proj.weight.mul_(head_scale.repeat_interleave(4)[:, None])   # MHA: head j's output x c_j
        mamba.norm.weight.copy_(mamba_scale.repeat_interleave(4))                 # head m's out_proj input x c_m
    importance = collect_importance(model, batches())
    assert torch.equal(importance.hidden.argsort(), hidden_scale.argsort())
    assert torch.equal(importance.neurons[1].argsort(), neuron_scale.argsort())
    assert torch.equal(importance.heads[0].argsort(), head_scale.argsort())
    assert torch.equal(importance.mamba_heads[2].argsort(), mamba_scale.argsort())

    widths = resolve_widths(model.config, dict(hidden_size=6, ffn_hidden_size=3, num_attention_heads=2,
                                               mamba_num_heads=2))
    pruned = prune_model(model, importance, widths)
    hidden = hidden_scale.topk(6).indices.sort().values
    neurons = neuron_scale.topk(3).indices.sort().values
    assert torch.equal(pruned.embedding.weight, model.embedding.weight[:, hidden])
    assert torch.equal(pruned.blocks[1].mixer.up_proj.weight, mlp.up_proj.weight[neurons][:, hidden])
    assert torch.equal(pruned.final_norm.weight, hidden_scale[hidden])
    rows = torch.cat([torch.arange(4) + 4 * head for head in (1, 3)])  # heads 1 and 3 (scales 3 and 2)
    assert pruned.config.num_kv_heads == 2 and pruned.config.head_dim == 4
    assert torch.equal(pruned.blocks[0].mixer.q_proj.weight, attention.q_proj.weight[rows][:, hidden])
    assert torch.equal(pruned.blocks[0].mixer.v_proj.weight, attention.v_proj.weight[rows][:, hidden])
    assert torch.equal(pruned.blocks[2].mixer.A_log, mamba.A_log[[0, 2]])  # heads 0 and 2 (scales 2 and 3)


def test_gqa_keeps_whole_groups_and_mamba_keeps_every_b_c_group():
    """Hand-made scores: KV group 1 has the larger sum though group 0 holds the best single query
    head; each Mamba group keeps its own best head; router-frequency scores pick the experts."""
    model = model_of(**HYBRID)
    config = model.config
    importance = Importance(hidden=torch.arange(32.), blocks=torch.zeros(6),
                            heads={1: torch.tensor([9., 0, 5, 5])},
                            neurons={2: torch.arange(128.), 5: torch.arange(128.)},
                            mamba_heads={0: torch.tensor([1., 2, 0, 3, 7, 4, 6, 5])},
                            experts={3: torch.tensor([0.1, 0.4, 0.3, 0.2])})
    pruned = prune_model(model, importance, resolve_widths(config, dict(num_kv_heads=1, mamba_num_heads=2,
                                                                        moe_num_experts=2)))
    old, new = model.blocks[1].mixer, pruned.blocks[1].mixer
    assert pruned.config.num_attention_heads == 2 and pruned.config.num_kv_heads == 1
    assert torch.equal(new.q_proj.weight, old.q_proj.weight[16:])   # query heads 2, 3: group 1, whole
    assert torch.equal(new.k_proj.weight, old.k_proj.weight[8:])    # KV head 1
    mamba_old, mamba_new = model.blocks[0].mixer, pruned.blocks[0].mixer
    assert torch.equal(mamba_new.D, mamba_old.D[[3, 4]])            # best of heads 0-3, best of heads 4-7
    channels = torch.cat([torch.arange(24, 32), torch.arange(32, 40)])
    bc = 2 * 2 * 8
    rows = torch.cat([channels, 64 + channels, 128 + torch.arange(bc), 128 + bc + torch.tensor([3, 4])])
    assert torch.equal(mamba_new.in_proj.weight, mamba_old.in_proj.weight[rows])
    assert torch.equal(mamba_new.conv1d.weight, mamba_old.conv1d.weight[torch.cat([channels, 64 + torch.arange(bc)])])
    assert torch.equal(mamba_new.norm.weight, mamba_old.norm.weight[channels])
    experts_old, experts_new = model.blocks[3].mixer, pruned.blocks[3].mixer
    assert torch.equal(experts_new.experts.up_weight, experts_old.experts.up_weight[[1, 2]])
    assert torch.equal(experts_new.router.weight, experts_old.router.weight[[1, 2]])
    with torch.no_grad():
        assert pruned(tokens()).logits.isfinite().all()


def test_a_per_head_qk_norm_keeps_the_rows_of_the_kept_heads():
    """StableLM 2 12B's and Command R+'s QK-norms have a weight row per head: pruning heads keeps
    exactly those heads' rows (the query norm's of the query heads, the key norm's of the KV heads)."""
    values = {**HYBRID, "qk_norm_type": "layernorm", "qk_norm_per_head": True, "qk_norm_bias": True}
    model = model_of(**values)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "_norm." in name:
                param.normal_(1.0, 0.3)
    importance = Importance(hidden=torch.arange(32.), blocks=torch.zeros(6), heads={1: torch.tensor([9., 0, 5, 5])},
                            neurons={2: torch.arange(128.), 5: torch.arange(128.)},
                            mamba_heads={0: torch.arange(8.)}, experts={3: torch.arange(4.)})
    pruned = prune_model(model, importance, resolve_widths(model.config, dict(num_kv_heads=1)))
    old, new = model.blocks[1].mixer, pruned.blocks[1].mixer
    assert new.q_norm.weight.shape == (2, 8) and new.k_norm.bias.shape == (1, 8)
    for part in ("weight", "bias"):
        assert torch.equal(getattr(new.q_norm, part), getattr(old.q_norm, part)[2:])  # query heads 2, 3
        assert torch.equal(getattr(new.k_norm, part), getattr(old.k_norm, part)[1:])  # KV head 1
    assert ParameterCounter(model.config)(pruned.config) == pruned.num_parameters()
    with torch.no_grad():
        assert pruned(tokens()).logits.isfinite().all()


def test_gpt_oss_sinks_and_expert_biases_follow_their_heads_experts_and_hidden_channels():
    """gpt-oss: a sink per query head, a router bias per expert, experts' gate/up biases per expert and a
    down bias per expert and hidden channel -- each cut with what it belongs to."""
    values = dict(vocab_size=64, hidden_size=32, pattern="*E", num_attention_heads=4, num_kv_heads=2,
                  attention_bias=True, attention_sinks=True, moe_num_experts=4, moe_top_k=2, moe_ffn_hidden_size=16,
                  moe_softmax_before_topk=False, moe_router_bias=True, moe_expert_linear_bias=True,
                  mlp_activation="clamped_swiglu")
    model = model_of(**values)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("sinks", "bias")):
                param.normal_(0.0, 0.5)
    importance = Importance(hidden=torch.arange(32.), blocks=torch.zeros(2), heads={0: torch.tensor([9., 0, 5, 5])},
                            neurons={}, mamba_heads={}, experts={1: torch.tensor([1., 7, 0, 3])})
    pruned = prune_model(model, importance, resolve_widths(model.config, dict(num_kv_heads=1, moe_num_experts=2,
                                                                             hidden_size=24)))
    old, new = model.blocks[0].mixer, pruned.blocks[0].mixer
    assert torch.equal(new.sinks, old.sinks[2:])  # query heads 2, 3 (KV head 1)
    kept_experts, kept_hidden = torch.tensor([1, 3]), torch.arange(8, 32)
    old_moe, new_moe = model.blocks[1].mixer, pruned.blocks[1].mixer
    assert torch.equal(new_moe.router.bias, old_moe.router.bias[kept_experts])
    assert torch.equal(new_moe.experts.up_bias, old_moe.experts.up_bias[kept_experts])
    assert torch.equal(new_moe.experts.gate_bias, old_moe.experts.gate_bias[kept_experts])
    assert torch.equal(new_moe.experts.down_bias, old_moe.experts.down_bias[kept_experts][:, kept_hidden])
    assert ParameterCounter(model.config)(pruned.config) == pruned.num_parameters()
    with torch.no_grad():
        assert pruned(tokens()).logits.isfinite().all()


@pytest.mark.parametrize("metric", ["cosine", "loss"])
def test_depth_pruning_drops_the_block_whose_removal_changes_the_output_least(metric):
    model = model_of(vocab_size=64, hidden_size=32, pattern="*-*-*-", num_attention_heads=4, ffn_hidden_size=64)
    with torch.no_grad():
        model.blocks[3].mixer.down_proj.weight.mul_(1e-3)   # block 3 barely changes the stream
        model.output.weight.mul_(20)                         # sharp logits: labels below are the model's own
        ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(3))
        labels = model(ids).logits.argmax(-1)
    importance = collect_importance(model, [{"input_ids": ids, "labels": labels}], depth_metric=metric)
    assert int(importance.blocks.argmin()) == 3
    pruned = prune_model(model, importance, original_widths(model.config), drop_blocks=1)
    assert pruned.config.pattern == "*-**-"
    assert torch.equal(pruned.blocks[3].mixer.q_proj.weight, model.blocks[4].mixer.q_proj.weight)  # renumbered
    with torch.no_grad():
        change = (pruned(ids).logits - model(ids).logits).abs().max() / model(ids).logits.abs().max()
    assert change < 1e-2


def test_a_parameter_budget_is_met_by_the_counted_model():
    model = model_of(**HYBRID)
    importance = collect_importance(model, batches())
    total = model.num_parameters()
    for fraction in (0.8, 0.5):
        budget = int(total * fraction)
        widths, counted = search_widths(model.config, importance, budget, {})
        pruned = prune_model(model, importance, widths)
        assert pruned.num_parameters() == counted <= budget
        assert counted > 0.8 * budget  # the grid gets close to the budget, not just under it
    fixed, _ = search_widths(model.config, importance, int(total * 0.8), {"hidden_size": 32})
    assert fixed.hidden_size == 32  # a size given with the budget is kept
    with pytest.raises(ConfigError, match="--target-params"):
        search_widths(model.config, importance, 1000, {})


def test_parameter_counter_agrees_with_the_model():
    config = ModelConfig(**HYBRID)
    assert ParameterCounter(config)(config) == LanguageModel(config).num_parameters()


def test_a_model_with_shared_parallel_norms_prunes_and_is_counted():
    """Falcon-7B's layer: the MLP beside each attention block applies that block's LayerNorm, and
    has none to prune or count; the importance scores (which leave one block out at a time) run."""
    model = model_of(vocab_size=64, hidden_size=32, pattern="*-*E", num_attention_heads=4, num_kv_heads=1,
                     norm="layernorm", mlp_activation="gelu", ffn_hidden_size=48, moe_num_experts=4,
                     moe_ffn_hidden_size=16, parallel_residual=True, parallel_residual_shared_norm=True)
    assert ParameterCounter(model.config)(model.config) == model.num_parameters()
    importance = collect_importance(model, batches())
    pruned = prune_model(model, importance, resolve_widths(model.config, dict(hidden_size=24, ffn_hidden_size=32)))
    assert not any(name.startswith(("blocks.1.norm", "blocks.3.norm")) for name in pruned.state_dict())
    assert pruned.blocks[1].input_norm is pruned.blocks[0].norm and pruned.blocks[0].norm.weight.shape == (24,)
    assert ParameterCounter(model.config)(pruned.config) == pruned.num_parameters()
    with torch.no_grad():
        assert pruned(tokens()).logits.isfinite().all()


@pytest.mark.parametrize("requested, words", [
    (dict(num_attention_heads=3), "--heads 3 must be a multiple of --kv-heads 2"),
    (dict(num_attention_heads=8), "--heads 8 must lie in [1, 4]"),
    (dict(num_attention_heads=4, num_kv_heads=1), "give --heads at most 2"),
    (dict(hidden_size=64), "--hidden 64 must lie in [1, 32]"),
    (dict(mamba_num_heads=3), "--mamba-heads 3 must be a multiple of model.mamba_num_groups=2"),
    (dict(moe_num_experts=1), "--experts 1 is below model.moe_top_k=2"),
])
def test_impossible_sizes_are_refused_naming_the_flag(requested, words):
    with pytest.raises(ConfigError) as error:
        resolve_widths(ModelConfig(**HYBRID), requested)
    assert words in str(error.value)


def test_a_flag_for_a_missing_block_kind_is_refused():
    with pytest.raises(ConfigError, match="--mamba-heads 2: the model has no 'M' blocks"):
        resolve_widths(ModelConfig(vocab_size=64, hidden_size=32, pattern="*-"), dict(mamba_num_heads=2))


def per_block_pruned(model, importance, requested):
    widths = resolve_widths(model.config, requested, per_block=True)
    sizes = per_block_sizes(model.config, importance, widths, list(range(model.config.num_blocks)))
    return prune_model(model, importance, widths, sizes=sizes), sizes


def test_per_block_gives_a_block_with_flat_scores_more_units_and_meets_the_total():
    """Block 1's neurons (and block 0's KV groups) all matter alike; block 3's (block 2's) matter in
    a few. Normalised by each block's mean, the flat block keeps more; the totals are exact."""
    model = model_of(vocab_size=64, hidden_size=32, pattern="*-*-", num_attention_heads=8, num_kv_heads=4,
                     head_dim=8, ffn_hidden_size=64)
    peaked = torch.cat([torch.full((8,), 100.0), torch.full((56,), 0.01)])
    importance = Importance(hidden=torch.ones(32), neurons={1: torch.ones(64), 3: peaked},
                            heads={0: torch.ones(8), 2: torch.tensor([0.1, 0.1, 9, 9, 0.1, 0.1, 0.2, 0.2])})
    pruned, sizes = per_block_pruned(model, importance, dict(ffn_hidden_size=32, num_kv_heads=2))
    assert (sizes[1]["ffn_hidden_size"], sizes[3]["ffn_hidden_size"]) == (56, 8)  # 64 = 2 x 32; block 3 at 1/8
    assert (sizes[0]["num_kv_heads"], sizes[2]["num_kv_heads"]) == (3, 1)         # 4 = 2 x 2; one group at least
    config = pruned.config
    assert (config.ffn_hidden_size, config.num_kv_heads, config.num_attention_heads) == (32, 2, 4)
    assert config.block_overrides == {0: {"num_attention_heads": 6, "num_kv_heads": 3},
                                      1: {"ffn_hidden_size": 56},
                                      2: {"num_attention_heads": 2, "num_kv_heads": 1},
                                      3: {"ffn_hidden_size": 8}}
    assert torch.equal(pruned.blocks[3].mixer.up_proj.weight, model.blocks[3].mixer.up_proj.weight[:8])
    assert torch.equal(pruned.blocks[2].mixer.k_proj.weight, model.blocks[2].mixer.k_proj.weight[8:16])  # group 1
    assert tuple(pruned.blocks[0].mixer.q_proj.weight.shape) == (6 * 8, 32)
    assert ModelConfig.from_dict(config.to_dict()) == config
    with torch.no_grad():
        assert pruned(tokens()).logits.isfinite().all()
    with pytest.raises(ConfigError, match="give --ffn at least 8"):
        per_block_pruned(model, importance, dict(ffn_hidden_size=4))


HYBRID_TWICE = dict(HYBRID, pattern="M*-EM*-E")


def test_per_block_with_equal_scores_is_the_uniform_model():
    model = model_of(**HYBRID_TWICE)
    blocks = range(8)
    importance = Importance(hidden=torch.arange(32.), heads={i: torch.ones(4) for i in blocks if i % 4 == 1},
                            neurons={i: torch.ones(128) for i in blocks if i % 4 == 2},
                            mamba_heads={i: torch.ones(8) for i in blocks if i % 4 == 0},
                            experts={i: torch.full((4,), 0.25) for i in blocks if i % 4 == 3})
    requested = dict(hidden_size=24, ffn_hidden_size=64, num_kv_heads=1, mamba_num_heads=4, moe_num_experts=2)
    per_block, _ = per_block_pruned(model, importance, requested)
    uniform = prune_model(model, importance, resolve_widths(model.config, requested))
    assert per_block.config == uniform.config and not per_block.config.block_overrides
    for name, value in uniform.state_dict().items():
        assert torch.equal(per_block.state_dict()[name], value), name


def test_a_model_with_block_overrides_is_pruned_again():
    model = model_of(**HYBRID_TWICE)
    importance = collect_importance(model, batches())
    first, sizes = per_block_pruned(model, importance, dict(ffn_hidden_size=64, num_kv_heads=1, mamba_num_heads=4,
                                                            moe_num_experts=2))
    assert sum(sizes[i]["ffn_hidden_size"] for i in (2, 6)) == 128 and sum(sizes[i]["mamba_num_heads"]
                                                                           for i in (0, 4)) == 8
    assert all(sizes[i]["moe_num_experts"] >= 2 for i in (3, 7))
    for index, size in sizes.items():   # the written model's blocks have the chosen sizes
        block = first.config.for_block(index)
        assert all(getattr(block, name) == value for name, value in size.items()), (index, size)
    again = collect_importance(first, batches())
    narrow = prune_model(first, again, resolve_widths(first.config, dict(hidden_size=16)))
    assert narrow.config.block_overrides == first.config.block_overrides
    assert first.config.block_overrides  # random scores: the two MLP blocks differ
    with pytest.raises(ConfigError, match="has its own ffn_hidden_size .* add --per-block"):
        resolve_widths(first.config, dict(ffn_hidden_size=32))
    second, _ = per_block_pruned(first, again, dict(ffn_hidden_size=32))
    assert sum(second.config.for_block(i).resolved_ffn_hidden_size for i in (2, 6)) == 64
    with torch.no_grad():
        assert narrow(tokens()).logits.isfinite().all() and second(tokens()).logits.isfinite().all()
    with pytest.raises(ConfigError, match="--target-params"):
        search_widths(first.config, again, 10_000, {})


LATENT = dict(vocab_size=64, hidden_size=32, pattern="*-*E", num_attention_heads=4, attention_type="mla",
              mla_q_lora_rank=12, mla_kv_lora_rank=8, mla_qk_nope_head_dim=6, mla_qk_rope_head_dim=4,
              mla_v_head_dim=5, ffn_hidden_size=48, moe_num_experts=4, moe_ffn_hidden_size=16)


def test_latent_attention_heads_are_cut_alone_and_the_latents_kept():
    """MLA: heads 1 and 3 survive block 0, in their rows of q_b (10 each) and kv_b (6 + 5 each) and
    their value columns of o; the latents keep every channel, their hidden-side columns cut."""
    model = model_of(**LATENT)
    assert prune_model(model, collect_importance(model, batches()), original_widths(model.config)
                       ).state_dict().keys() == model.state_dict().keys()
    importance = Importance(hidden=torch.arange(32.), heads={0: torch.tensor([1., 9, 2, 8]), 2: torch.arange(4.)},
                            neurons={1: torch.ones(48)}, experts={3: torch.ones(4)})
    pruned = prune_model(model, importance, resolve_widths(model.config, dict(num_attention_heads=2, hidden_size=24)))
    config, old, new = pruned.config, model.blocks[0].mixer, pruned.blocks[0].mixer
    assert (config.num_attention_heads, config.num_kv_heads, config.head_dim, config.hidden_size) == (2, None, None, 24)
    hidden = torch.arange(8, 32)
    assert torch.equal(new.q_b_proj.weight, old.q_b_proj.weight[torch.cat([torch.arange(10, 20), torch.arange(30, 40)])])
    assert torch.equal(new.kv_b_proj.weight, old.kv_b_proj.weight[torch.cat([torch.arange(11, 22),
                                                                             torch.arange(33, 44)])])
    assert torch.equal(new.o_proj.weight, old.o_proj.weight[hidden][:, torch.cat([torch.arange(5, 10),
                                                                                   torch.arange(15, 20)])])
    assert torch.equal(new.kv_a_proj.weight, old.kv_a_proj.weight[:, hidden])
    assert torch.equal(new.q_a_proj.weight, old.q_a_proj.weight[:, hidden])
    assert torch.equal(new.kv_a_norm.weight, old.kv_a_norm.weight)
    assert ParameterCounter(config)(config) == pruned.num_parameters()
    with torch.no_grad():
        assert pruned(tokens()).logits.isfinite().all()
    per_block, sizes = per_block_pruned(model, Importance(hidden=torch.ones(32), heads={
        0: torch.ones(4), 2: torch.tensor([0.01, 0.01, 0.01, 9.0])}, neurons={1: torch.ones(48)},
        experts={3: torch.ones(4)}), dict(num_attention_heads=2))
    assert per_block.config.block_overrides == {0: {"num_attention_heads": 3}, 2: {"num_attention_heads": 1}}
    assert tuple(per_block.blocks[2].mixer.kv_b_proj.weight.shape) == (11, 8)
