"""``model.parallel_residual``: an attention block and the MLP, MoE or Mamba block after it read one
input, h + attn(norm1(h)) + mlp(norm2(h)) (GPT-J, GPT-NeoX; Falcon-H1 with Mamba), checked against that formula written out from
the model's own modules; the same function under recomputation, in cached generation and in the
decode step; pipeline stages that never split a pair."""

import pytest
import torch

from meshlm.adapt.importance import forward_loss
from meshlm.config import ParallelConfig
from meshlm.errors import ConfigError
from meshlm.inference.decode_step import DecodeStep
from meshlm.models.cache import InferenceCache
from meshlm.models.config import ModelConfig
from meshlm.models.context import SequenceContext
from meshlm.models.language_model import LanguageModel
from meshlm.models.pattern import parallel_residual_pairs
from meshlm.parallel.mesh import check_layout
from meshlm.parallel.pipeline.stages import stage_starts
from meshlm.training.recompute import apply_recompute

VOCAB = 97


def neox_like(pattern: str = "**-*E-", **overrides) -> LanguageModel:
    """Biases, LayerNorm, GELU, a quarter of each head rotated (Pythia's shape), and a lone
    attention block (0) and a lone MLP (5) that stay sequential."""
    torch.manual_seed(0)
    values = dict(vocab_size=VOCAB, hidden_size=32, pattern=pattern, num_attention_heads=4, norm="layernorm",
                  mlp_activation="gelu", attention_bias=True, mlp_bias=True, rope_fraction=0.25, init_std=0.1,
                  moe_num_experts=4, moe_top_k=2, moe_ffn_hidden_size=32, parallel_residual=True)
    return LanguageModel(ModelConfig(**{**values, **overrides}))


def written_out(model: LanguageModel, input_ids: torch.Tensor) -> torch.Tensor:
    """The logits of h + attn(norm1(h)) + mlp(norm2(h)) for each pair, h + mixer(norm(h)) for the
    other blocks, from the model's own modules."""
    context = SequenceContext.for_tokens(input_ids)
    hidden = model.embed(input_ids, context)
    pairs = dict(parallel_residual_pairs(model.config.block_kinds))
    index = 0
    while index < len(model.blocks):
        block = model.blocks[index]
        mixed = block.mixer(block.norm(hidden), context)
        if index in pairs:
            partner = model.blocks[pairs[index]]
            norm = block.norm if model.config.parallel_residual_shared_norm else partner.norm
            feed_forward = partner.mixer(norm(hidden), context)
            feed_forward = feed_forward[0] if isinstance(feed_forward, tuple) else feed_forward  # MoE losses
            hidden = hidden + mixed + feed_forward
            index += 2
        else:
            hidden = hidden + (mixed[0] if isinstance(mixed, tuple) else mixed)
            index += 1
    return model.head_logits(hidden)


def test_pairs_are_each_attention_block_and_the_block_after_it():
    assert parallel_residual_pairs("*-*-") == [(0, 1), (2, 3)]
    assert parallel_residual_pairs("**-*E-") == [(1, 2), (3, 4)]
    assert parallel_residual_pairs("M*-*0-") == [(1, 2)]
    assert parallel_residual_pairs("*M-*M-") == [(0, 1), (3, 4)]  # Falcon-H1: attention beside Mamba
    assert parallel_residual_pairs("-M*0*") == []
    roles = [block.parallel_residual_role for block in neox_like().blocks]
    assert roles == [None, "first", "second", "first", "second", None]
    assert [block.parallel_residual_role for block in neox_like(parallel_residual=False).blocks] == [None] * 6


FALCON_H1_LIKE = dict(pattern="**M-*M-", mamba_head_dim=8, mamba_state_size=8, mamba_chunk_size=8,
                     mamba_gated_norm=False)
"""Attention beside Mamba (Falcon-H1's layer, its Mamba without an output norm), after a lone attention block."""


@pytest.mark.parametrize("shape", ["neox", "falcon-h1"])
@pytest.mark.parametrize("shared_norm", [False, True], ids=["own norms", "shared norm"])
def test_forward_and_gradients_are_the_written_out_parallel_layer(shared_norm, shape):
    shape = FALCON_H1_LIKE if shape == "falcon-h1" else {}
    model = neox_like(parallel_residual_shared_norm=shared_norm, **shape)
    with torch.no_grad():  # norms that differ: a partner using the wrong one changes the logits
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.3)
    input_ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    logits = model(input_ids).logits
    expected = written_out(model, input_ids)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    if shared_norm:  # the feed-forward blocks of the pairs own no norm; the attention blocks' serve both
        names = {name for name, _ in model.named_parameters()}
        assert "blocks.2.norm.weight" not in names and "blocks.1.norm.weight" in names
        assert model.blocks[2].input_norm is model.blocks[1].norm
    # the sequential model computes another function: the test can tell them apart
    sequential = neox_like(parallel_residual=False, **shape)
    sequential.load_state_dict(model.state_dict(), strict=not shared_norm)
    assert (sequential(input_ids).logits - expected).abs().max() > 1e-2
    weights = torch.randn_like(logits)
    grads = torch.autograd.grad((logits * weights).sum(), list(model.parameters()))
    expected_grads = torch.autograd.grad((written_out(model, input_ids) * weights).sum(), list(model.parameters()),
                                         allow_unused=True)
    for (name, _), grad, expected_grad in zip(model.named_parameters(), grads, expected_grads):
        if "router" in name and expected_grad is None:
            continue
        torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-6, msg=name)


def test_skipping_an_attention_block_leaves_its_partner_on_its_own_input():
    """An importance score's left-out block (``adapt/importance.forward_loss``) is the identity: the
    MLP beside it then reads its own input, as in the model with that block removed ('0')."""
    model = neox_like()
    removed = neox_like("*0-*E-")
    state = {name: value for name, value in model.state_dict().items() if not name.startswith("blocks.1.")}
    removed.load_state_dict(state)
    assert [block.parallel_residual_role for block in removed.blocks][1:3] == [None, None]
    input_ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        skipped = forward_loss(model, input_ids, input_ids, skip=1)
        torch.testing.assert_close(skipped, removed(input_ids, labels=input_ids).losses["lm"], rtol=1e-6, atol=1e-6)
        assert abs(skipped - forward_loss(model, input_ids, input_ids)) > 1e-3


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recomputation_keeps_the_loss_and_gradients(recompute):
    input_ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    results = []
    for setting in ("none", recompute):
        model = neox_like()
        apply_recompute(model, setting)
        loss = model(input_ids, labels=input_ids).loss
        loss.backward()
        results.append((loss.detach(), {name: param.grad for name, param in model.named_parameters()}))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=0)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("shape", ["neox", "falcon-h1"])
@pytest.mark.parametrize("shared_norm", [False, True], ids=["own norms", "shared norm"])
@torch.inference_mode()
def test_cached_generation_and_the_decode_step_match_the_full_forward(shared_norm, shape):
    shape = {**FALCON_H1_LIKE, "pattern": "*M-*M-"} if shape == "falcon-h1" else {"pattern": "*-*-"}
    model = neox_like(parallel_residual_shared_norm=shared_norm, **shape).eval()
    input_ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(3))
    full = model(input_ids).logits
    cache, stepped = InferenceCache(max_tokens=16), InferenceCache(max_tokens=16)
    torch.testing.assert_close(model(input_ids[:, :6], cache=cache).logits, full[:, :6], rtol=1e-5, atol=1e-5)
    model(input_ids[:, :6], cache=stepped)
    step = DecodeStep(model)
    assert step.supports(stepped)
    for position in range(6, 10):
        cached = model(input_ids[:, position:position + 1], cache=cache).logits[:, -1]
        torch.testing.assert_close(cached, full[:, position], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(step(input_ids[:, position], stepped), cached, rtol=1e-5, atol=1e-5)


def test_pipeline_stages_never_split_a_pair():
    config = neox_like("*-*-*-*-").config
    # six units of cost a, m: an even split of 8 blocks into 3 stages would cut inside a pair
    for stages in (2, 3, 4):
        starts = stage_starts(config, stages, seq_len=16)
        assert len(starts) == stages and all(start % 2 == 0 for start in starts), starts
    sequential = neox_like("*-*-*-*-", parallel_residual=False).config
    assert any(start % 2 for start in stage_starts(sequential, 3, seq_len=16))  # unconstrained, it would
    with pytest.raises(ConfigError, match=r"8 blocks make 4 units a stage can hold .* parallel.vp = 5 pipeline"):
        stage_starts(config, 5, seq_len=16)
    marked = neox_like("*-*|-*-").config
    with pytest.raises(ConfigError, match="between blocks 2 and 3, which model.parallel_residual runs side by side"):
        stage_starts(marked, 2, seq_len=16)
    assert stage_starts(neox_like("*-|*-*-").config, 2, seq_len=16) == [0, 2]


def test_a_shared_norm_is_refused_where_it_cannot_work():
    with pytest.raises(ConfigError, match="parallel_residual_shared_norm=true .* model.parallel_residual is false"):
        ModelConfig(pattern="*-", parallel_residual_shared_norm=True)
    with pytest.raises(ConfigError, match="block_input_norm is false"):
        ModelConfig(pattern="*-", parallel_residual=True, parallel_residual_shared_norm=True, block_input_norm=False,
                    block_output_norm=True)
    config = ModelConfig(pattern="*-", parallel_residual=True, parallel_residual_shared_norm=True)
    with pytest.raises(ConfigError, match="zero_stage=3 gathers each block's weights .* use parallel.zero_stage=2"):
        check_layout(ParallelConfig(zero_stage=3), config, world_size=2)
    assert check_layout(ParallelConfig(zero_stage=2), config, world_size=2) == 2


def test_a_pattern_without_a_pair_is_refused_by_name():
    with pytest.raises(ConfigError, match="parallel_residual=true runs each attention block .*'-M-M' has no such pair"):
        ModelConfig(pattern="-M-M", parallel_residual=True)
