import pytest
import torch

from meshlm.errors import ConfigError
from meshlm.models.cache import InferenceCache
from meshlm.models.config import ModelConfig
from meshlm.models.context import SequenceContext
from meshlm.models.language_model import LanguageModel
from meshlm.models.losses import IGNORE_INDEX
from tests.helpers.cached_decoding import (assert_cached_generation_equals_the_full_forward,
                                           assert_decode_step_equals_the_cached_forward)


def tiny(**overrides):
    values = dict(vocab_size=64, hidden_size=32, pattern="*-*-", num_attention_heads=4, num_kv_heads=2)
    values.update(overrides)
    torch.manual_seed(0)
    return LanguageModel(ModelConfig(**values))


def test_loss_is_mean_next_token_cross_entropy_and_ignores_masked_labels():
    model = tiny()
    tokens = torch.randint(0, 64, (2, 12))
    labels = tokens.roll(-1, 1)
    labels[:, -1] = IGNORE_INDEX
    output = model(tokens, labels)
    logits = output.logits[:, :-1].reshape(-1, 64)
    expected = torch.nn.functional.cross_entropy(logits, labels[:, :-1].reshape(-1))
    torch.testing.assert_close(output.loss, expected)
    output.loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_scaled_init_on_output_projections():
    model = tiny(init_std=0.05, pattern="*-" * 8, hidden_size=64)
    expected = 0.05 / (2 * 16) ** 0.5
    down = torch.cat([b.mixer.down_proj.weight.flatten() for b in model.blocks if b.kind == "-"])
    up = torch.cat([b.mixer.up_proj.weight.flatten() for b in model.blocks if b.kind == "-"])
    assert down.std().item() == pytest.approx(expected, rel=0.05)
    assert up.std().item() == pytest.approx(0.05, rel=0.05)


def test_tied_embeddings_share_one_matrix():
    model = tiny(tie_embeddings=True)
    assert model.output is None and model.output_weight() is model.embedding.weight
    assert "output.weight" not in model.state_dict()


def test_kv_cache_prefill_then_steps_equals_full_forward():
    model = tiny().eval()
    tokens = torch.randint(0, 64, (2, 10))
    full = model(tokens).logits
    cache = InferenceCache()
    pieces = [model(tokens[:, :6], cache=cache).logits]
    pieces += [model(tokens[:, i:i + 1], cache=cache).logits for i in range(6, 10)]
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-5, atol=1e-5)


def test_layernorm_and_no_rope_variants_run():
    model = tiny(norm="layernorm", position_embedding="none", mlp_activation="gelu")
    out = model(torch.randint(0, 64, (1, 5)), torch.randint(0, 64, (1, 5)))
    assert torch.isfinite(out.loss)


def test_multi_token_prediction_losses():
    model = tiny(mtp_depth=2, mtp_loss_coeff=0.5)
    tokens = torch.randint(0, 64, (2, 12))
    labels = tokens.roll(-1, 1)
    labels[:, -1] = IGNORE_INDEX
    output = model(tokens, labels)
    assert set(output.losses) == {"lm", "mtp_1", "mtp_2", "mtp"}
    torch.testing.assert_close(output.losses["mtp"], (output.losses["mtp_1"] + output.losses["mtp_2"]) / 2)
    torch.testing.assert_close(output.loss, output.losses["lm"] + 0.5 * output.losses["mtp"])
    output.loss.backward()
    assert model.mtp.depths[1].projection.weight.grad.abs().sum() > 0


def test_mtp_depth_one_predicts_two_ahead():
    """Depth 1 at position t sees token t+1's embedding and is scored against token t+2."""
    model = tiny(mtp_depth=1)
    tokens = torch.randint(0, 64, (1, 8))
    labels = tokens.roll(-1, 1)
    labels[:, -1] = IGNORE_INDEX
    loss_full = model(tokens, labels).losses["mtp_1"]
    # Changing the last token changes only the target of position 5 and the input of position 6
    # (whose target is ignored); position 6's own target (token 8) does not exist.
    from meshlm.models.mtp import shift_left
    assert shift_left(labels, 1, IGNORE_INDEX)[0, -2:].tolist() == [IGNORE_INDEX, IGNORE_INDEX]
    assert shift_left(labels, 1, IGNORE_INDEX)[0, 0] == tokens[0, 2]
    assert torch.isfinite(loss_full)


def gemma_style(**fields) -> ModelConfig:
    return ModelConfig(**{**dict(vocab_size=50, hidden_size=16, pattern="*-E", num_attention_heads=2, num_kv_heads=1,
                                 mlp_activation="geglu", qk_norm=True, block_output_norm=True, norm_zero_centered=True,
                                 embedding_multiplier=4.0, moe_num_experts=2, moe_top_k=1), **fields})


def test_block_output_norm_normalizes_each_mixer_output_before_the_residual_add():
    from meshlm.models.context import SequenceContext

    torch.manual_seed(0)
    model = LanguageModel(gemma_style()).double()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.1)
    hidden = torch.randn(2, 5, 16, dtype=torch.float64)
    context = SequenceContext.for_tokens(torch.zeros(2, 5, dtype=torch.long))
    for block in model.blocks:
        mixed = block.mixer(block.norm(hidden), context)
        mixed = mixed[0] if isinstance(mixed, tuple) else mixed  # the MoE block's losses
        rms = mixed.pow(2).mean(-1, keepdim=True).add(block.output_norm.eps).rsqrt()
        expected = hidden + mixed * rms * (1 + block.output_norm.weight)
        torch.testing.assert_close(block(hidden, context), expected, rtol=0, atol=1e-6)  # norms work in fp32
    plain = LanguageModel(gemma_style(block_output_norm=False))
    assert all(block.output_norm is None for block in plain.blocks)
    assert len(list(model.parameters())) == len(list(plain.parameters())) + 3  # one weight per block


def test_embedding_multiplier_scales_the_embeddings_in_their_dtype():
    torch.manual_seed(0)
    model = LanguageModel(gemma_style(embedding_multiplier=16 ** 0.5 + 0.01))
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(model.embed(ids), model.embedding(ids) * (4.01), rtol=0, atol=0)
    model = model.to(torch.bfloat16)  # as transformers does: the multiplier rounded to bf16 first (4.0)
    assert torch.equal(model.embed(ids), model.embedding(ids) * torch.tensor(4.01, dtype=torch.bfloat16))


@pytest.mark.parametrize("fields, message", [
    (dict(norm="layernorm"), "model.norm_zero_centered=true is for RMSNorm"),
    (dict(embedding_multiplier=0), "model.embedding_multiplier=0 must be a positive number"),
    (dict(rope_local_theta=1e4), "model.rope_local_theta=10000.0 is the RoPE base of sliding-window blocks"),
    (dict(sliding_window=4, rope_local_theta=-1.0), "model.rope_local_theta=-1.0 must be a positive number"),
])
def test_gemma_fields_are_checked_by_name(fields, message):
    with pytest.raises(ConfigError, match=message):
        gemma_style(**fields)


def test_sliding_blocks_take_the_local_rope_base_unscaled():
    config = gemma_style(pattern="*-*-*-", sliding_window=4, sliding_window_pattern="SSF", rope_theta=1e6,
                         rope_scaling="linear", rope_scaling_factor=8.0, rope_local_theta=1e4)
    model = LanguageModel(config)
    rotaries = [block.mixer.rotary for block in model.blocks if block.kind == "*"]
    assert [rotary.theta for rotary in rotaries] == [1e4, 1e4, 1e6]
    assert [rotary.scaling.kind for rotary in rotaries] == ["none", "none", "linear"]


# --- muP-style constants (Granite): model.residual_multiplier, model.logit_divisor ------------------------

def multiplied_model(**overrides) -> LanguageModel:
    torch.manual_seed(0)
    values = dict(vocab_size=97, hidden_size=32, pattern="*-*-", num_attention_heads=4, num_kv_heads=2,
                  init_std=0.1, residual_multiplier=0.3, logit_divisor=2.5, embedding_multiplier=4.0)
    return LanguageModel(ModelConfig(**{**values, **overrides}))


def test_the_residual_multiplier_scales_each_blocks_output_and_the_divisor_the_logits():
    model = multiplied_model().eval()
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden = model.embed(ids)
        expected = model.embed(ids)
        context_model = LanguageModel(ModelConfig(**{**model.config.to_dict(), "residual_multiplier": 1.0,
                                                     "logit_divisor": 1.0}))
        context_model.load_state_dict(model.state_dict())
        context = SequenceContext.for_tokens(ids)
        for block, plain in zip(model.blocks, context_model.eval().blocks):
            hidden = block(hidden, context)
            expected = expected + 0.3 * (plain(expected, context) - expected)  # m * (what the block adds)
        torch.testing.assert_close(hidden, expected, rtol=1e-5, atol=1e-6)
        logits, plain_logits = model(ids).logits, context_model(ids).logits
    assert not torch.allclose(logits * 2.5, plain_logits, atol=1e-3)  # the residual multiplier changes the model
    torch.testing.assert_close(logits * 2.5, model.head_logits(hidden) * 2.5, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("softcap", [None, 0.4])
def test_the_fused_loss_divides_and_caps_like_the_logits(softcap):
    model = multiplied_model(final_logit_softcap=softcap).train()
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(2))
    labels = ids.roll(-1, dims=1)
    unfused = model(ids, labels)
    unfused_grads = torch.autograd.grad(unfused.loss, list(model.parameters()))
    fused = model(ids, labels, return_logits=False)
    torch.testing.assert_close(fused.loss, unfused.loss, rtol=1e-6, atol=0)
    for actual, wanted in zip(torch.autograd.grad(fused.loss, list(model.parameters())), unfused_grads):
        torch.testing.assert_close(actual, wanted, rtol=1e-4, atol=1e-7)


def test_cached_decoding_applies_the_residual_multiplier():
    model = multiplied_model().eval()
    assert_cached_generation_equals_the_full_forward(model)
    assert_decode_step_equals_the_cached_forward(model)


@pytest.mark.parametrize("field", ["residual_multiplier", "logit_divisor"])
def test_a_multiplier_must_be_positive(field):
    with pytest.raises(ConfigError, match=f"model.{field}=0 must be a positive number"):
        ModelConfig(vocab_size=64, hidden_size=32, num_attention_heads=4, **{field: 0})
