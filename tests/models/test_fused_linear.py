"""meshlm/models/fused_linear.py: q/k/v and gate/up as one GEMM, equal to the separate layers."""

import pytest
import torch
from torch import nn

from meshlm.models.attention import SelfAttention
from meshlm.models.config import ModelConfig
from meshlm.models.fused_linear import project_together, runs_fused
from meshlm.models.mlp import MLP


def layers(*widths, bias=False, seed=0):
    torch.manual_seed(seed)
    return tuple(nn.Linear(16, width, bias=bias).double() for width in widths)


@pytest.mark.parametrize("bias", [False, True])
def test_one_gemm_gives_each_layer_its_output_and_gradients(bias):
    parts = layers(32, 8, 8, bias=bias)
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    cotangents = [torch.randn(3, 5, layer.out_features, dtype=torch.float64) for layer in parts]
    leaves = [x] + [p for layer in parts for p in layer.parameters()]

    def values_and_grads(outputs):
        grads = torch.autograd.grad(sum((out * c).sum() for out, c in zip(outputs, cotangents)), leaves)
        return [out.detach() for out in outputs] + list(grads)

    fused = values_and_grads(project_together(x, parts))
    separate = values_and_grads([layer(x) for layer in parts])
    for got, want in zip(fused, separate):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


class CountingLinear(nn.Linear):
    """A subclass whose forward does something of its own (as a quantized layer does)."""

    calls = 0

    def forward(self, x):
        CountingLinear.calls += 1
        return super().forward(x)


def test_layers_with_a_forward_of_their_own_run_separately(monkeypatch):
    plain = layers(8, 8)
    calls = []
    monkeypatch.setattr(nn.Linear, "forward", lambda self, x: calls.append(self) or nn.functional.linear(
        x, self.weight, self.bias))
    x = torch.randn(2, 16, dtype=torch.float64)
    assert runs_fused(plain[0])
    project_together(x, plain)
    assert calls == []  # fused: neither layer's forward ran
    handle = plain[0].register_forward_pre_hook(lambda module, args: None)
    assert not runs_fused(plain[0])
    project_together(x, plain)
    assert calls == list(plain)  # a hook: each layer's own forward, hooks and all
    handle.remove()
    subclass = CountingLinear(16, 8).double()
    assert not runs_fused(subclass)
    project_together(x, (plain[0], subclass))
    assert CountingLinear.calls == 1
    mixed = (nn.Linear(16, 8, bias=True).double(), nn.Linear(16, 8, bias=False).double())
    calls.clear()
    project_together(x, mixed)  # one bias, one without: separately
    assert calls == list(mixed)


def test_attention_and_gated_mlp_project_in_one_gemm(monkeypatch):
    """The modules' forwards take the fused path: one F.linear for q, k, v and one for gate and up."""
    config = ModelConfig(vocab_size=32, hidden_size=32, num_attention_heads=4, num_kv_heads=2, pattern="*-",
                         ffn_hidden_size=48)
    attention, mlp = SelfAttention(config, 0), MLP(32, 48, "swiglu")
    shapes = []
    linear = nn.functional.linear
    monkeypatch.setattr(nn.functional, "linear", lambda x, w, b=None: shapes.append(tuple(w.shape)) or linear(x, w, b))
    x = torch.randn(2, 6, 32)
    attention.project(x, torch.arange(6)[None].expand(2, 6))
    mlp(x)
    assert shapes == [(32 + 2 * 16, 32), (2 * 48, 32), (32, 48)]


def test_backward_keeps_the_input_and_the_layers_own_weights_not_their_concatenation():
    from tests.helpers.saved_tensors import SavedStorages
    parts = layers(32, 8, 8, bias=True)
    x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    with SavedStorages() as saved:
        project_together(x, parts)
    assert saved.pointers == {tensor.untyped_storage().data_ptr() for tensor in (x, *(p.weight for p in parts))}


def test_a_compiled_gated_mlp_has_no_graph_break_training_or_evaluating():
    """fullgraph=True: with autograd (the custom function) and without (evaluation: plain ops)."""
    torch.manual_seed(0)
    mlp = MLP(16, 24, "swiglu")
    compiled = torch.compile(mlp, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 5, 16, requires_grad=True)
    compiled(x).sum().backward()
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), mlp(x))


def test_frozen_weights_get_no_gradient_and_the_input_still_does():
    parts = layers(8, 8)
    for layer in parts:
        layer.weight.requires_grad_(False)
    x = torch.randn(3, 16, dtype=torch.float64, requires_grad=True)
    (grad_fused,) = torch.autograd.grad(sum(out.sum() for out in project_together(x, parts)), x)
    (grad_separate,) = torch.autograd.grad(sum(layer(x).sum() for layer in parts), x)
    torch.testing.assert_close(grad_fused, grad_separate, rtol=1e-12, atol=1e-12)
    assert all(layer.weight.grad is None for layer in parts)
