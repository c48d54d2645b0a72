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
