import pytest
import torch

from meshlm.models.config import ModelConfig
from meshlm.models.moe.experts import GroupedExperts, grouped_linear, grouped_mm_supported


def make_experts(activation="swiglu", **overrides):
    values = dict(pattern="E", hidden_size=32, moe_num_experts=4, moe_top_k=2, moe_ffn_hidden_size=16,
                  mlp_activation=activation, init_std=0.2)
    values.update(overrides)
    torch.manual_seed(0)
    return GroupedExperts(ModelConfig(**values), model_size=32)


def per_expert_reference(experts, tokens, tokens_per_expert):
    """Each row through its own expert, one row at a time (no grouping at all)."""
    row_experts = torch.repeat_interleave(torch.arange(len(tokens_per_expert)), tokens_per_expert)
    outputs = []
    for row, expert in zip(tokens, row_experts.tolist()):
        up = experts.up_weight[expert] @ row
        if experts.gate_weight is not None:
            hidden = torch.nn.functional.silu(experts.gate_weight[expert] @ row) * up
        else:
            hidden = torch.relu(up).square()
        outputs.append(experts.down_weight[expert] @ hidden)
    return torch.stack(outputs)


def test_grouped_mm_runs_on_cpu_for_aligned_fp32():
    # Reported by the MoE work: in torch 2.13 F.grouped_mm runs on CPU in fp32 (strides 16-byte aligned).
    assert grouped_mm_supported(torch.randn(6, 32), torch.randn(4, 16, 32))
    assert not grouped_mm_supported(torch.randn(6, 5), torch.randn(4, 16, 5))  # 20-byte rows


@pytest.mark.parametrize("activation", ["swiglu", "squared_relu"])
@pytest.mark.parametrize("use_grouped_mm", [True, False])
def test_both_implementations_match_a_row_by_row_reference(activation, use_grouped_mm):
    experts = make_experts(activation)
    experts.use_grouped_mm = use_grouped_mm
    tokens_per_expert = torch.tensor([3, 0, 5, 2])  # expert 1 receives nothing
    tokens = torch.randn(10, 32)
    output = experts(tokens, tokens_per_expert)
    torch.testing.assert_close(output, per_expert_reference(experts, tokens, tokens_per_expert))


def test_grouped_mm_and_segment_loop_agree_in_values_and_gradients():
    experts = make_experts()
    tokens = torch.randn(9, 32, requires_grad=True)
    tokens_per_expert = torch.tensor([0, 4, 0, 5])
    results = []
    for use_grouped_mm in (True, False):
        experts.use_grouped_mm = use_grouped_mm
        output = experts(tokens, tokens_per_expert)
        grads = torch.autograd.grad(output.square().sum(), [tokens, *experts.parameters()])
        results.append((output, grads))
    torch.testing.assert_close(results[0][0], results[1][0])
    for grouped_grad, loop_grad in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(grouped_grad, loop_grad)
    up_grad = results[0][1][2]
    assert up_grad[0].abs().sum() == 0 and up_grad[1].abs().sum() > 0  # empty expert gets no gradient


def test_no_tokens_at_all():
    experts = make_experts()
    for use_grouped_mm in (True, False):
        output = grouped_linear(torch.randn(0, 32), experts.up_weight, torch.zeros(4, dtype=torch.long), use_grouped_mm)
        assert output.shape == (0, 16)


def test_parameter_shapes_and_init():
    config = ModelConfig(pattern="E" * 8, hidden_size=32, moe_num_experts=8, moe_ffn_hidden_size=64, init_std=0.05)
    experts = GroupedExperts(config, model_size=32)
    assert experts.gate_weight.shape == experts.up_weight.shape == (8, 64, 32)
    assert experts.down_weight.shape == (8, 32, 64)
    assert experts.up_weight.std().item() == pytest.approx(0.05, rel=0.05)
    assert experts.down_weight.std().item() == pytest.approx(config.output_init_std, rel=0.05)
    assert make_experts("squared_relu").gate_weight is None
