import pytest
import torch

from meshlm.errors import ConfigError
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel
from meshlm.training.recompute import apply_recompute
from tests.helpers.saved_tensors import SavedStorages

SETTINGS = [("selective", 1), ("full", 1), ("full", 2)]


def tiny(pattern: str, **overrides) -> LanguageModel:
    values = dict(vocab_size=64, hidden_size=32, pattern=pattern, num_attention_heads=4, num_kv_heads=2,
                  mamba_head_dim=8, mamba_chunk_size=8, moe_num_experts=4, moe_top_k=2, moe_ffn_hidden_size=32,
                  moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
    values.update(overrides)
    torch.manual_seed(0)
    return LanguageModel(ModelConfig(**values))


def loss_and_grads(model, mode: str, every: int = 1, token_mask=None):
    apply_recompute(model, mode, every)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    tokens = torch.randint(0, 64, (2, 16))
    output = model(tokens, tokens.roll(-1, 1), token_mask=token_mask)
    output.loss.backward()
    return output, {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("pattern", ["*-*-", "M*-E"])
@pytest.mark.parametrize("mode,every", SETTINGS)
def test_recompute_gives_bitwise_identical_loss_and_gradients(pattern, mode, every):
    # The backward graph is the one recorded by the first forward; recomputation only refills the
    # tensors it reads, by the same kernels on the same inputs, so fp32 results match bit for bit.
    model = tiny(pattern)
    reference, reference_grads = loss_and_grads(model, "none")
    output, grads = loss_and_grads(model, mode, every)
    assert torch.equal(output.loss, reference.loss)
    for name in output.losses:
        assert torch.equal(output.losses[name], reference.losses[name]), name
    for name, grad in grads.items():
        assert torch.equal(grad, reference_grads[name]), name


def test_recompute_with_padding_mask_and_mtp_matches():
    model = tiny("*-", mtp_depth=1)
    token_mask = torch.ones(2, 16, dtype=torch.bool)
    token_mask[0, :5] = False  # left padding takes the masked attention path
    reference, reference_grads = loss_and_grads(model, "none", token_mask=token_mask)
    for mode in ("selective", "full"):
        output, grads = loss_and_grads(model, mode, token_mask=token_mask)
        assert torch.equal(output.loss, reference.loss)
        assert all(torch.equal(grads[name], reference_grads[name]) for name in grads)


def test_moe_losses_are_collected_once_per_block_with_full_recompute():
    model = tiny("E-E-")
    apply_recompute(model, "full")
    seen = []
    model.blocks[0].register_forward_hook(lambda module, args, out: seen.append(len(args[1].moe_losses)))
    tokens = torch.randint(0, 64, (2, 16))
    output = model(tokens, tokens)
    assert len(output.tokens_per_expert) == 2 and seen == [1]
    output.losses["moe_aux"].backward()  # the aux loss still reaches the router weights
    assert model.blocks[0].mixer.router.weight.grad.abs().sum() > 0


def test_flags_follow_the_mode():
    model = tiny("*-*-*-")
    apply_recompute(model, "full", every=2)
    assert [block.recompute for block in model.blocks] == [True, False, True, False, True, False]
    assert not any(block.mixer.recompute_core for block in model.blocks if block.kind == "*")
    apply_recompute(model, "selective")
    assert not any(block.recompute for block in model.blocks)
    assert all(block.mixer.recompute_core for block in model.blocks if block.kind == "*")
    apply_recompute(model, "none")
    assert not any(block.mixer.recompute_core for block in model.blocks if block.kind == "*")


def test_recompute_saves_fewer_activations():
    def saved_bytes(mode):
        model = tiny("*-", hidden_size=64, num_attention_heads=4)
        apply_recompute(model, mode)
        tokens = torch.randint(0, 64, (2, 64))
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            with SavedStorages() as saved:
                model(tokens, tokens)
        return saved.nbytes

    none, selective, full = saved_bytes("none"), saved_bytes("selective"), saved_bytes("full")
    assert full < selective < none


def test_bad_mode_is_a_config_error():
    with pytest.raises(ConfigError, match="train.recompute"):
        apply_recompute(tiny("*-"), "sometimes")
    with pytest.raises(ConfigError, match="recompute_every"):
        apply_recompute(tiny("*-"), "full", every=0)
