import pytest
import torch

from meshlm.models.cache import InferenceCache
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel
from meshlm.models.losses import IGNORE_INDEX


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
    from meshlm.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        gemma_style(**fields)


def test_sliding_blocks_take_the_local_rope_base_unscaled():
    config = gemma_style(pattern="*-*-*-", sliding_window=4, sliding_window_pattern="SSF", rope_theta=1e6,
                         rope_scaling="linear", rope_scaling_factor=8.0, rope_local_theta=1e4)
    model = LanguageModel(config)
    rotaries = [block.mixer.rotary for block in model.blocks if block.kind == "*"]
    assert [rotary.theta for rotary in rotaries] == [1e4, 1e4, 1e6]
    assert [rotary.scaling.kind for rotary in rotaries] == ["none", "none", "linear"]
