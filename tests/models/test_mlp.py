"""The MLP's activations (meshlm/models/mlp.py): GeGLU is GELU's tanh approximation of the gate
times the up projection, in the dense MLP and in the MoE experts alike."""

import torch
import torch.nn.functional as F

from meshlm.models.config import ModelConfig
from meshlm.models.mlp import MLP, activate, is_gated
from meshlm.models.moe.layer import MoELayer


def test_geglu_is_tanh_gelu_of_the_gate_times_up():
    gate, up = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)
    tanh_gelu = 0.5 * gate * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate ** 3)))
    torch.testing.assert_close(activate("geglu", up, gate), tanh_gelu * up, rtol=0, atol=1e-14)
    assert is_gated("geglu") and is_gated("swiglu") and not is_gated("gelu")
    mlp = MLP(8, 12, "geglu").double()
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    expected = mlp.down_proj(F.gelu(mlp.gate_proj(x), approximate="tanh") * mlp.up_proj(x))
    torch.testing.assert_close(mlp(x), expected, rtol=0, atol=1e-14)
    assert ModelConfig(mlp_activation="geglu", hidden_size=96).resolved_ffn_hidden_size == 256  # 8/3 h, as SwiGLU


def test_moe_experts_with_geglu_equal_each_expert_as_a_dense_mlp():
    torch.manual_seed(0)
    config = ModelConfig(pattern="E", hidden_size=16, moe_num_experts=4, moe_top_k=2, moe_ffn_hidden_size=24,
                         mlp_activation="geglu")
    layer = MoELayer(config).double()
    x = torch.randn(1, 6, 16, dtype=torch.float64)
    out, _ = layer(x)
    routing = layer.router(x.flatten(0, 1), record_load=False)
    weights, chosen = routing.weights.double(), routing.expert_ids
    experts = layer.experts
    expected = torch.zeros(6, 16, dtype=torch.float64)
    for token in range(6):
        for slot in range(2):
            expert = int(chosen[token, slot])
            hidden = x[0, token]
            gate, up = experts.gate_weight[expert] @ hidden, experts.up_weight[expert] @ hidden
            mixed = F.gelu(gate, approximate="tanh") * up
            expected[token] += weights[token, slot] * (experts.down_weight[expert] @ mixed)
    torch.testing.assert_close(out.flatten(0, 1), expected, rtol=1e-6, atol=1e-9)  # the router works in fp32
