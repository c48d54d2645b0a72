import math

import pytest
import torch

from meshlm.errors import ConfigError
from meshlm.models.block import Block
from meshlm.models.config import ModelConfig
from meshlm.models.context import SequenceContext
from meshlm.models.language_model import LanguageModel
from meshlm.models.mlp import MLP
from meshlm.models.moe.layer import MoELayer


def make_config(**overrides):
    values = dict(pattern="E", hidden_size=32, moe_num_experts=4, moe_top_k=2, moe_ffn_hidden_size=16, init_std=0.2)
    values.update(overrides)
    return ModelConfig(**values)


def make_layer(**overrides):
    torch.manual_seed(0)
    return MoELayer(make_config(**overrides))


def token_by_token_reference(layer, x):
    """The MoE block written as its definition: for each token, the weighted sum of its experts."""
    tokens = x.reshape(-1, x.shape[-1])
    routing = layer.router(tokens)
    experts = layer.experts
    outputs = []
    for j, token in enumerate(tokens):
        z = layer.latent_in_proj(token) if layer.latent_in_proj is not None else token
        y = torch.zeros_like(z)
        for expert, weight in zip(routing.expert_ids[j].tolist(), routing.weights[j]):
            up = experts.up_weight[expert] @ z
            gate = experts.gate_weight[expert] @ z if experts.gate_weight is not None else None
            hidden = torch.nn.functional.silu(gate) * up if gate is not None else torch.relu(up).square()
            y = y + weight * (experts.down_weight[expert] @ hidden)
        y = layer.latent_out_proj(y) if layer.latent_out_proj is not None else y
        if layer.shared_expert is not None:
            gate = layer.shared_expert_gate
            scale = 1.0 if gate is None else torch.sigmoid(gate.weight[0] @ token)
            y = y + scale * layer.shared_expert(token)
        outputs.append(y)
    return torch.stack(outputs).reshape(x.shape)


@pytest.mark.parametrize("activation", ["swiglu", "squared_relu"])
def test_one_expert_top_1_equals_the_dense_mlp(activation):
    layer = make_layer(moe_num_experts=1, moe_top_k=1, mlp_activation=activation)
    mlp = MLP(32, 16, activation)
    with torch.no_grad():
        mlp.up_proj.weight.copy_(layer.experts.up_weight[0])
        mlp.down_proj.weight.copy_(layer.experts.down_weight[0])
        if mlp.gate_proj is not None:
            mlp.gate_proj.weight.copy_(layer.experts.gate_weight[0])
    x = torch.randn(2, 8, 32)
    output, losses = layer(x)
    torch.testing.assert_close(output, mlp(x))
    assert losses.tokens_per_expert.tolist() == [16]


@pytest.mark.parametrize("overrides", [
    dict(),
    dict(mlp_activation="squared_relu", moe_score_function="sigmoid", moe_normalize_topk=True,
         moe_routed_scaling_factor=2.5),
    dict(moe_shared_expert_ffn_hidden_size=24),
    dict(moe_shared_expert_ffn_hidden_size=24, moe_shared_expert_gate=True),
    dict(moe_latent_size=16, moe_shared_expert_ffn_hidden_size=24, mlp_bias=True, mlp_activation="squared_relu"),
])
def test_layer_matches_the_token_by_token_definition(overrides):
    layer = make_layer(**overrides)
    x = torch.randn(2, 6, 32)
    torch.testing.assert_close(layer(x)[0], token_by_token_reference(layer, x))


def test_shared_expert_is_added_to_the_routed_output():
    layer = make_layer(moe_shared_expert_ffn_hidden_size=24)
    x = torch.randn(2, 5, 32)
    with_shared = layer(x)[0]
    shared = layer.shared_expert
    layer.shared_expert = None
    torch.testing.assert_close(with_shared, layer(x)[0] + shared(x))


def test_the_shared_expert_gate_scales_its_output_per_token_and_learns():
    layer = make_layer(moe_shared_expert_ffn_hidden_size=24, moe_shared_expert_gate=True)
    x = torch.randn(2, 5, 32)
    gated = layer(x)[0]
    scale = torch.sigmoid(x @ layer.shared_expert_gate.weight[0])[..., None]
    assert 0.05 < float(scale.detach().std())  # a different scale per token, not a constant
    gate, layer.shared_expert_gate = layer.shared_expert_gate, None
    ungated = layer(x)[0]
    shared = layer.shared_expert(x)
    torch.testing.assert_close(gated, ungated - shared + scale * shared)
    layer.shared_expert_gate = gate
    layer(x)[0].square().sum().backward()
    assert gate.weight.grad is not None and gate.weight.grad.abs().sum() > 0


def test_a_shared_expert_gate_without_a_shared_expert_is_refused():
    with pytest.raises(ConfigError, match="model.moe_shared_expert_ffn_hidden_size > 0"):
        make_config(moe_shared_expert_gate=True)


def test_latent_moe_shapes():
    layer = make_layer(moe_latent_size=16, moe_ffn_hidden_size=32)
    assert layer.router.weight.shape == (4, 32)  # the router sees the full hidden state
    assert layer.latent_in_proj.weight.shape == (16, 32) and layer.latent_out_proj.weight.shape == (32, 16)
    assert layer.experts.gate_weight.shape == layer.experts.up_weight.shape == (4, 32, 16)
    assert layer.experts.down_weight.shape == (4, 16, 32)
    output, _ = layer(torch.randn(3, 4, 32))
    assert output.shape == (3, 4, 32)
    assert make_layer().latent_in_proj is None


def test_aux_and_z_loss_through_the_layer_on_hand_made_logits():
    # hidden 3, tokens e_0 and e_1, so the logits are the router weight's columns:
    # token 0 -> log(1, 2, 1), token 1 -> log(2, 1, 1) (see test_router for the hand computation).
    layer = make_layer(hidden_size=3, moe_num_experts=3, moe_top_k=1, moe_ffn_hidden_size=4)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[:, 0] = torch.log(torch.tensor([1.0, 2.0, 1.0]))
        layer.router.weight[:, 1] = torch.log(torch.tensor([2.0, 1.0, 1.0]))
    _, losses = layer(torch.tensor([[[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]]))
    assert losses.tokens_per_expert.tolist() == [1, 1, 0]
    assert losses.aux_loss.item() == pytest.approx(9 / 8, abs=1e-6)
    assert losses.z_loss.item() == pytest.approx(math.log(4) ** 2, abs=1e-6)


def test_gradients_reach_router_and_every_used_expert_and_an_unused_expert_works():
    layer = make_layer(moe_score_function="sigmoid")
    layer.router.expert_bias[3] = -10.0  # expert 3 is never chosen
    output, losses = layer(torch.randn(2, 8, 32))
    assert losses.tokens_per_expert[3].item() == 0 and losses.tokens_per_expert.sum().item() == 32
    (output.square().sum() + losses.aux_loss + losses.z_loss).backward()
    assert layer.router.weight.grad.abs().sum() > 0
    for weight in (layer.experts.gate_weight, layer.experts.up_weight, layer.experts.down_weight):
        assert (weight.grad[:3].flatten(1).abs().sum(-1) > 0).all()
        assert weight.grad[3].abs().sum() == 0


def all_tokens_to_expert_0_layer(**overrides):
    """top-1 over 2 experts; the router weight makes every token pick expert 0."""
    layer = make_layer(moe_num_experts=2, moe_top_k=1, **overrides)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0, 0] = 1.0  # logit of expert 0 = x_0, of expert 1 = 0
    x = torch.randn(1, 8, 32)
    x[..., 0] = torch.linspace(1.0, 2.0, 8)  # x_0 > 0, and increasing with position
    return layer, x


def test_capacity_drops_the_right_tokens_and_they_get_zero_output():
    layer, x = all_tokens_to_expert_0_layer(moe_capacity_factor=0.5)  # capacity ceil(0.5 * 8 / 2) = 2
    output, losses = layer(x)
    assert losses.tokens_per_expert.tolist() == [8, 0]  # counted before dropping
    assert losses.dropped_tokens.item() == 6
    kept = output.abs().sum(-1).flatten() > 0
    assert kept.tolist() == [False] * 6 + [True] * 2  # policy "probs": the two largest weights are the last tokens
    assert torch.equal(output[0, :6], torch.zeros(6, 32))
    block = Block("E", make_config(moe_num_experts=2, moe_top_k=1, moe_capacity_factor=0.5), 0)
    block.mixer = layer
    block_output = block(x, SequenceContext.for_tokens(torch.zeros(1, 8, dtype=torch.long)))
    assert torch.equal(block_output[0, :6], x[0, :6])  # dropped tokens pass through the residual only


def test_position_policy_keeps_the_earliest_tokens_and_dropping_is_deterministic():
    layer, x = all_tokens_to_expert_0_layer(moe_capacity_factor=0.5, moe_drop_policy="position")
    output, _ = layer(x)
    assert (output.abs().sum(-1).flatten() > 0).tolist() == [True] * 2 + [False] * 6
    assert torch.equal(output, layer(x)[0])


def test_dropped_token_with_a_shared_expert_gets_only_the_shared_output():
    layer, x = all_tokens_to_expert_0_layer(moe_capacity_factor=0.5, moe_shared_expert_ffn_hidden_size=24)
    output, _ = layer(x)
    torch.testing.assert_close(output[0, :6], layer.shared_expert(x[0, :6]))


def test_language_model_collects_moe_losses_and_backpropagates():
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=64, hidden_size=32, pattern="*E*E", num_attention_heads=4, moe_num_experts=4,
                         moe_top_k=2, moe_ffn_hidden_size=16, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
    model = LanguageModel(config)
    tokens = torch.randint(0, 64, (2, 16))
    output = model(tokens, tokens.roll(-1, 1))
    assert set(output.losses) >= {"lm", "moe_aux", "moe_z"}
    assert output.losses["moe_aux"].item() > 0 and output.losses["moe_z"].item() > 0
    torch.testing.assert_close(output.loss, output.losses["lm"] + 0.01 * output.losses["moe_aux"]
                               + 0.001 * output.losses["moe_z"])
    assert [t.sum().item() for t in output.tokens_per_expert] == [2 * 16 * 2] * 2
    output.loss.backward()
    for block in model.blocks[1::2]:
        assert block.mixer.router.weight.grad.abs().sum() > 0
        assert block.mixer.experts.down_weight.grad.abs().sum() > 0


def test_latent_moe_sends_latent_rows_to_the_experts_and_its_gradients_match_the_definition():
    # LatentMoE (Nemotron 3): what a dispatcher moves -- the permuted rows in, the expert rows out --
    # is latent-wide (16), not hidden-wide (32): all-to-all bytes shrink by hidden / latent.
    layer = make_layer(moe_latent_size=16, moe_shared_expert_ffn_hidden_size=24, mlp_bias=True)
    seen = []
    layer.experts.register_forward_hook(lambda module, inputs, output: seen.append((inputs[0].shape, output.shape)))
    x = torch.randn(2, 6, 32, requires_grad=True)
    output, _ = layer(x)
    assert seen == [((2 * 6 * 2, 16), (2 * 6 * 2, 16))]
    probe = torch.randn_like(output)
    gradients = torch.autograd.grad((output * probe).sum(), [x, *layer.parameters()])
    reference = token_by_token_reference(layer, x)
    expected = torch.autograd.grad((reference * probe).sum(), [x, *layer.parameters()])
    for name, actual, wanted in zip(["input", *dict(layer.named_parameters())], gradients, expected):
        torch.testing.assert_close(actual, wanted, msg=name)
    assert gradients[0].abs().sum() > 0 and all(g.abs().sum() > 0 for g in gradients[1:])
