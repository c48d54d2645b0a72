"""Muon (meshlm/optim/muon.py): the Newton-Schulz orthogonalization, the update rule against the
formulas written out here, AdamW's half bit-equal to torch's AdamW, which parameters Muon takes,
and the settings the configuration refuses."""

from __future__ import annotations

import math

import pytest
import torch

from meshlm.config import OptimConfig, load_run_config
from meshlm.errors import ConfigError
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel
from meshlm.optim.adamw import build_adamw
from meshlm.optim.build import build_optimizer
from meshlm.optim.muon import MUON_GROUP, Muon, muon_parameter, orthogonalize, update_scale

MUON = OptimConfig(optimizer="muon", lr=0.02, weight_decay=0.1)


def hybrid_moe_model() -> LanguageModel:
    config = ModelConfig(vocab_size=64, hidden_size=32, num_attention_heads=4, num_kv_heads=2, pattern="M*E-",
                         mamba_head_dim=8, mamba_state_size=8, mamba_num_groups=4, mamba_chunk_size=8,
                         moe_num_experts=4, moe_top_k=2, moe_ffn_hidden_size=16,
                         moe_shared_expert_ffn_hidden_size=16, moe_shared_expert_gate=True, mtp_depth=1,
                         tie_embeddings=False, attention_sinks=True, moe_router_bias=True,
                         moe_expert_linear_bias=True)
    return LanguageModel(config, seed=0)


@pytest.mark.parametrize("shape", [(48, 48), (24, 64), (64, 24), (3, 16, 40)])
def test_orthogonalize_moves_every_singular_value_near_one_and_keeps_the_singular_vectors(shape):
    """NS5 of G = U S V^T is U S' V^T with S' in about [0.7, 1.2] (Jordan et al. 2024): checked
    as the singular values of the result, and as U^T O V being diagonal (the same vectors), for
    square, wide, tall and stacked (expert) matrices with a spread of singular values."""
    generator = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(*shape[:-1], shape[-2], generator=generator))
    v, _ = torch.linalg.qr(torch.randn(*shape[:-2], shape[-1], shape[-1], generator=generator))
    rank = min(shape[-2:])
    spread = torch.logspace(0, -2, rank)  # singular values over two decades
    matrix = (u[..., :, :rank] * spread) @ v[..., :, :rank].mT
    result = orthogonalize(matrix, steps=5)
    assert result.shape == matrix.shape and result.dtype == torch.float32
    singular = torch.linalg.svdvals(result)
    assert singular.min() > 0.65 and singular.max() < 1.25, singular
    projected = u[..., :, :rank].mT @ result @ v[..., :, :rank]
    diagonal = torch.diagonal(projected, dim1=-2, dim2=-1)
    off = projected - torch.diag_embed(diagonal)
    assert off.abs().max() < 1e-4 * diagonal.abs().min(), "the singular vectors must not change"


def test_orthogonalize_of_zero_is_zero():
    assert orthogonalize(torch.zeros(8, 16), steps=5).abs().max() == 0


def reference_muon(weight: torch.Tensor, grads: list[torch.Tensor], lr: float, decay: float, momentum: float,
                   nesterov: bool) -> torch.Tensor:
    """Liu et al. 2025, Algorithm 1, written out: M = mu M + G; U = G + mu M (Nesterov) or M;
    W = W (1 - lr wd) - lr 0.2 sqrt(max(A, B)) NS5(U)."""
    weight, buffer = weight.clone(), torch.zeros_like(weight)
    for grad in grads:
        buffer = momentum * buffer + grad
        direction = grad + momentum * buffer if nesterov else buffer
        weight = weight * (1 - lr * decay) - lr * 0.2 * math.sqrt(max(weight.shape)) * orthogonalize(direction, 5)
    return weight


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_step_follows_the_moonlight_update(nesterov):
    generator = torch.Generator().manual_seed(1)
    weight = torch.nn.Parameter(torch.randn(24, 40, generator=generator))
    grads = [torch.randn(24, 40, generator=generator) for _ in range(3)]
    expected = reference_muon(weight.detach(), grads, lr=0.02, decay=0.1, momentum=0.9, nesterov=nesterov)
    config = OptimConfig(optimizer="muon", lr=0.02, weight_decay=0.1, muon_momentum=0.9, muon_nesterov=nesterov)
    optimizer = build_optimizer([("blocks.0.mixer.up_proj.weight", weight)], config)
    for grad in grads:
        weight.grad = grad.clone()
        optimizer.step()
    torch.testing.assert_close(weight.detach(), expected, rtol=1e-6, atol=1e-6)


def test_update_rms_is_the_configured_one():
    """From zero momentum, lr 1 and no decay, one step moves a matrix by about muon_update_rms in
    RMS (NS5's singular values are 0.7-1.2, not exactly 1)."""
    for shape in ((64, 64), (32, 128)):
        weight = torch.nn.Parameter(torch.zeros(shape))
        weight.grad = torch.randn(shape, generator=torch.Generator().manual_seed(2))
        config = OptimConfig(optimizer="muon", lr=1.0, weight_decay=0.0, muon_update_rms=0.2, muon_nesterov=False)
        build_optimizer([("blocks.1.mixer.o_proj.weight", weight)], config).step()
        rms = weight.detach().pow(2).mean().sqrt().item()
        assert 0.14 < rms < 0.24, (shape, rms)
    assert update_scale(torch.Size([4, 32, 128]), 0.2) == pytest.approx(0.2 * math.sqrt(128))


def test_muon_takes_the_blocks_matrices_and_adamw_everything_else():
    model = hybrid_moe_model()
    optimizer = build_optimizer(list(model.named_parameters()), MUON)
    assert isinstance(optimizer, Muon)
    groups = {group["name"]: set(group["param_names"]) for group in optimizer.param_groups}
    expected_muon = {
        "blocks.0.mixer.in_proj.weight", "blocks.0.mixer.out_proj.weight",
        *(f"blocks.1.mixer.{name}_proj.weight" for name in "qkvo"),
        *(f"blocks.2.mixer.experts.{name}_weight" for name in ("gate", "up", "down")),
        *(f"blocks.2.mixer.shared_expert.{name}_proj.weight" for name in ("gate", "up", "down")),
        *(f"blocks.3.mixer.{name}_proj.weight" for name in ("gate", "up", "down")),
        "mtp.depths.0.projection.weight",
        *(f"mtp.depths.0.blocks.0.mixer.{name}_proj.weight" for name in "qkvo"),
        *(f"mtp.depths.0.blocks.1.mixer.{name}_proj.weight" for name in ("gate", "up", "down"))}
    assert groups[MUON_GROUP] == expected_muon
    # AdamW's own split (adamw.py): matrices decay, the embedding, norms and 1-D parameters do not
    assert {"output.weight", "blocks.2.mixer.router.weight", "blocks.2.mixer.shared_expert_gate.weight",
            "blocks.0.mixer.conv1d.weight"} <= groups["decay"]
    assert {"embedding.weight", "blocks.0.mixer.A_log", "blocks.0.norm.weight"} <= groups["no_decay"]
    # gpt-oss's sinks, router bias and the stacked experts' biases ([E, F], [E, d]: matrices in shape only)
    assert {"blocks.1.mixer.sinks", "blocks.2.mixer.router.bias", "blocks.2.mixer.experts.gate_bias",
            "blocks.2.mixer.experts.down_bias"} <= groups["no_decay"]
    every = {name for name, _ in model.named_parameters()}
    assert sum(len(names) for names in groups.values()) == len(every) and set().union(*groups.values()) == every


def test_adamw_half_steps_exactly_as_torch_adamw():
    """The parameters Muon does not take step bit for bit as ``build_adamw``'s torch AdamW (same
    groups, same fused kernel); the optimizer's state dict round-trips."""
    ours, theirs = hybrid_moe_model(), hybrid_moe_model()
    muon = build_optimizer(list(ours.named_parameters()), MUON)
    rest = [(name, param) for name, param in theirs.named_parameters() if not muon_parameter(name, param)]
    adamw = build_adamw(rest, MUON)
    generator = torch.Generator().manual_seed(3)
    for _ in range(3):
        for (name, mine), (_, other) in zip(ours.named_parameters(), theirs.named_parameters()):
            grad = torch.randn(mine.shape, generator=generator)
            mine.grad, other.grad = grad.clone(), grad.clone()
        muon.step()
        adamw.step()
    for (name, mine), (_, other) in zip(ours.named_parameters(), theirs.named_parameters()):
        if not muon_parameter(name, mine):
            assert mine.equal(other), name
    restored = build_optimizer(list(ours.named_parameters()), MUON)
    restored.load_state_dict(muon.state_dict())
    for param in muon.state:
        for key, value in muon.state[param].items():
            assert restored.state[param][key].equal(value), key
    assert {"momentum_buffer"} == set(muon.state[ours.blocks[1].mixer.q_proj.weight])


def test_adamw_is_still_the_default():
    model = hybrid_moe_model()
    assert type(build_optimizer(list(model.named_parameters()), OptimConfig())) is torch.optim.AdamW


@pytest.mark.parametrize("overrides,match", [
    (["optim.optimizer=lion"], "optim.optimizer='lion' is not one of adamw, muon"),
    (["optim.muon_momentum=1.0"], r"optim.muon_momentum=1.0 must lie in \[0, 1\)"),
    (["optim.muon_ns_steps=0"], "optim.muon_ns_steps=0 must be an integer >= 1"),
    (["optim.muon_update_rms=0"], "optim.muon_update_rms=0.0 must be > 0"),
    (["model.lora_rank=4"], "model.lora_rank=4 only low-rank adapters train; use optim.optimizer=adamw"),
])
def test_config_refuses_what_muon_cannot_do(overrides, match):
    muon = [] if overrides[0].startswith("optim.optimizer") else ["optim.optimizer=muon"]
    with pytest.raises(ConfigError, match=match):
        load_run_config(None, [*muon, *overrides])
