"""Heterogeneous stacks: ``model.block_overrides``, linear ``L`` and no-op ``0`` blocks.

Checked in one process: each block is built with its own sizes (``ModelConfig.for_block``) and
the overrides survive YAML, the command line and a JSON round trip; a linear block computes
h + W norm(h) and a no-op block h; the FLOPs of each block follow the hand formulas with its own
sizes, and pipeline stages are cut by them; generation with the cache (each attention block's
own KV heads, no state for linear / no-op blocks) equals greedy decoding by full forwards;
invalid overrides, layouts that cannot split a block, and HF export are refused in one sentence
naming the block and the field.
"""

from __future__ import annotations

import json

import pytest
import torch

from meshlm.config import ParallelConfig, load_run_config
from meshlm.errors import ConfigError
from meshlm.hf.convert import choose_architecture
from meshlm.inference.generate import generate
from meshlm.inference.sampling import SamplingConfig
from meshlm.models.cache import AttentionCache, InferenceCache, MambaCache
from meshlm.models.config import ModelConfig
from meshlm.models.context import SequenceContext
from meshlm.models.flops import model_flops_breakdown
from meshlm.models.language_model import LanguageModel
from meshlm.parallel.mesh import check_layout
from meshlm.parallel.pipeline.stages import stage_starts

H = 32
HETEROGENEOUS = dict(
    vocab_size=64, hidden_size=H, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=64,
    pattern="M*-EL0*-", mamba_head_dim=8, mamba_state_size=8, mamba_num_groups=2, mamba_chunk_size=8,
    moe_num_experts=4, moe_top_k=2, moe_ffn_hidden_size=32,
    block_overrides={0: {"mamba_num_heads": 4}, 1: {"num_attention_heads": 2, "num_kv_heads": 1},
                     2: {"ffn_hidden_size": 32}, 3: {"moe_num_experts": 2, "moe_ffn_hidden_size": 16},
                     6: {"num_kv_heads": 4}})


def make_model(seed: int = 0) -> LanguageModel:
    return LanguageModel(ModelConfig(**HETEROGENEOUS), seed=seed)


def test_every_block_is_built_with_its_own_sizes():
    model = make_model()
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert shapes["blocks.0.mixer.A_log"] == (4,)  # 4 Mamba heads instead of 2 * 32 / 8 = 8
    assert shapes["blocks.1.mixer.q_proj.weight"] == (2 * 8, H)  # 2 heads of the model's head_dim 8
    assert shapes["blocks.1.mixer.k_proj.weight"] == (1 * 8, H)
    assert shapes["blocks.6.mixer.k_proj.weight"] == (4 * 8, H)
    assert shapes["blocks.2.mixer.up_proj.weight"] == (32, H) and shapes["blocks.7.mixer.up_proj.weight"] == (64, H)
    assert shapes["blocks.3.mixer.experts.up_weight"] == (2, 16, H)
    assert shapes["blocks.3.mixer.router.weight"] == (2, H)
    assert shapes["blocks.4.mixer.out_proj.weight"] == (H, H) and "blocks.4.mixer.out_proj.bias" not in shapes
    assert not any(name.startswith("blocks.5.") for name in shapes)  # the no-op block has no parameters


def test_linear_block_is_residual_plus_matrix_times_norm_and_no_op_is_identity():
    model = make_model()
    hidden = torch.randn(2, 5, H)
    context = SequenceContext.for_tokens(torch.zeros(2, 5, dtype=torch.long))
    linear, no_op = model.blocks[4], model.blocks[5]
    expected = hidden + linear.norm(hidden) @ linear.mixer.out_proj.weight.T
    torch.testing.assert_close(linear(hidden, context), expected)
    assert no_op(hidden, context) is hidden


def test_overrides_come_from_yaml_and_the_command_line_and_survive_json():
    run = load_run_config(None, ["model.pattern=*-*-", "model.block_overrides={1: {ffn_hidden_size: 128}, "
                                 "2: {num_kv_heads: 1}}"])
    assert run.model.block_overrides == {1: {"ffn_hidden_size": 128}, 2: {"num_kv_heads": 1}}
    assert run.model.for_block(1).resolved_ffn_hidden_size == 128
    assert run.model.for_block(3) is run.model  # no overrides: the model's own config
    config = ModelConfig(**HETEROGENEOUS)
    reloaded = ModelConfig.from_dict(json.loads(json.dumps(config.to_dict())))  # JSON keys are strings
    assert reloaded == config and reloaded.for_block(3).moe_num_experts == 2


@pytest.mark.parametrize("overrides, message", [
    ({8: {"ffn_hidden_size": 32}}, "has block 8, but model.pattern='M*-EL0*-' has 8 blocks; use an index from 0 to 7"),
    ({2: {"hidden_size": 16}}, "model.block_overrides[2].hidden_size cannot be set per block; the per-block "
                               "fields are ffn_hidden_size, head_dim"),
    ({0: {"ffn_hidden_size": 32}}, "model.block_overrides[0].ffn_hidden_size does not apply to block 0, a mamba2 "
                                   "block ('M'), which takes mamba_num_heads"),
    ({4: {"ffn_hidden_size": 32}}, "does not apply to block 4, a linear block ('L'), which takes no overrides"),
    ({1: {"num_attention_heads": 3}}, "model.block_overrides[1] (attention block '*'): model.num_kv_heads=2 must "
                                      "divide model.num_attention_heads=3"),
    ({3: {"moe_num_experts": 1}}, "model.block_overrides[3] (moe block 'E'): model.moe_top_k=2 exceeds "
                                  "model.moe_num_experts=1"),
    ({2: 64}, "model.block_overrides[2]=64 must be a mapping of fields"),
])
def test_invalid_overrides_are_refused_in_one_sentence(overrides, message):
    with pytest.raises(ConfigError) as error:
        ModelConfig(**dict(HETEROGENEOUS, block_overrides=overrides))
    assert message in str(error.value)


def test_block_flops_follow_the_hand_formulas_with_each_blocks_sizes():
    T, d = 16, 8
    parts = model_flops_breakdown(ModelConfig(**HETEROGENEOUS), T)

    def attention(heads, kv_heads):
        return 2 * H * (2 * heads * d + 2 * kv_heads * d) * T + 2 * 2 * heads * d * T * T

    assert parts["blocks.1"] == attention(2, 1) and parts["blocks.6"] == attention(4, 4)
    assert parts["blocks.2"] == 3 * 2 * H * 32 * T and parts["blocks.7"] == 3 * 2 * H * 64 * T  # SwiGLU
    assert parts["blocks.3"] == 2 * H * 2 * T + 2 * T * 3 * 2 * H * 16  # router over 2 experts, top-2 of width 16
    assert parts["blocks.4"] == 2 * H * H * T  # linear
    assert parts["blocks.5"] == 0  # no-op
    inner, bc, heads = 4 * 8, 2 * 8, 4  # the Mamba block's 4 heads
    projections = 2 * H * (2 * inner + 2 * bc + heads) * T + 2 * inner * H * T
    assert parts["blocks.0"] - projections == 2 * (inner + 2 * bc) * 4 * T + (
        2 * 2 * 2 * 8 * 8 * 8 + 3 * 2 * heads * 2 * 8 * 8 * 8
        + 2 * heads * 3 * 2 * 8 * 8)  # conv + SSD (2 chunks of 8: a 3 x 2 state-passing matmul)


def test_pipeline_stages_are_balanced_by_each_blocks_flops():
    uniform = ModelConfig(vocab_size=64, hidden_size=H, pattern="----", ffn_hidden_size=64)
    assert stage_starts(uniform, 2, 16) == [0, 2]  # uniform blocks: as before
    wide_first = ModelConfig(vocab_size=64, hidden_size=H, pattern="----", ffn_hidden_size=64,
                             block_overrides={0: {"ffn_hidden_size": 512}})
    assert stage_starts(wide_first, 2, 16) == [0, 1]  # block 0 alone outweighs the other three
    removed = ModelConfig(vocab_size=64, hidden_size=H, pattern="--00--", ffn_hidden_size=64)
    assert stage_starts(removed, 2, 16) in ([0, 2], [0, 3], [0, 4])  # no-op blocks weigh nothing


def test_generation_with_cache_equals_greedy_full_forwards():
    model = make_model().eval()
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    generated = generate(model, prompts, 6, SamplingConfig(greedy=True))
    with torch.no_grad():
        for prompt, new_tokens in zip(prompts, generated):
            tokens = list(prompt)
            for _ in range(6):
                tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
            assert new_tokens == tokens[len(prompt):]
        cache = InferenceCache()
        model(torch.tensor(prompts), cache=cache)
    assert sorted(cache.layers) == [0, 1, 6]  # linear, no-op, MLP and MoE blocks keep no state
    assert isinstance(cache.layers[0], MambaCache) and cache.layers[0].ssm_state.shape[1] == 4
    assert isinstance(cache.layers[1], AttentionCache) and cache.layers[1].keys.shape[1] == 1
    assert cache.layers[6].keys.shape[1] == 4


def test_layouts_that_cannot_split_a_block_name_it():
    config = ModelConfig(vocab_size=64, hidden_size=H, num_attention_heads=4, pattern="*-*-", ffn_hidden_size=64,
                         block_overrides={2: {"num_attention_heads": 2}, 3: {"ffn_hidden_size": 36}})
    with pytest.raises(ConfigError, match=r"model.num_attention_heads of block 2 \(model.block_overrides\) = 2 is "
                                          r"not divisible by parallel.tp=4; each rank must hold whole heads"):
        check_layout(ParallelConfig(tp=4), config, 4)
    narrow = ModelConfig(**dict(config.to_dict(), num_attention_heads=8, block_overrides={3: {"ffn_hidden_size": 36}}))
    with pytest.raises(ConfigError, match=r"model.ffn_hidden_size of block 3 \(model.block_overrides\) = 36 is not "
                                          r"divisible by parallel.tp=8"):
        check_layout(ParallelConfig(tp=8), narrow, 8)
    assert check_layout(ParallelConfig(tp=2), config, 2) == 1


def test_hf_export_refuses_per_block_sizes_and_replaced_blocks():
    llama_like = ModelConfig(vocab_size=64, hidden_size=H, pattern="*-*-", ffn_hidden_size=64,
                             block_overrides={3: {"ffn_hidden_size": 128}})
    with pytest.raises(ConfigError) as error:
        choose_architecture(llama_like, "LlamaForCausalLM")
    assert ("cannot be written as LlamaForCausalLM: model.block_overrides (block 3 sets ffn_hidden_size: these "
            "formats have one size per field for all layers)") in str(error.value)
    with pytest.raises(ConfigError) as error:
        choose_architecture(ModelConfig(**HETEROGENEOUS))
    assert "linear/no-op blocks 4 ('L'), 5 ('0') in model.pattern" in str(error.value)
    assert "NemotronHForCausalLM: " in str(error.value)
