"""Quantized layers reading one input, cast once (meshlm/precision/quantized_projections.py),
against the same layers run one by one: the same outputs and weight gradients bit for bit, the
same delayed-scaling histories, and one FP8 cast of the input where there were three. And the
weights' codes kept over a step's micro-batches (quantized_linear.keeping_weight_codes): the
numbers of casting them at every micro-batch, one cast a step."""

import contextlib
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from meshlm.models.fused_linear import project_together
from meshlm.precision.delayed_scaling import DelayedScaling
from meshlm.precision.fp8_gemm import hardware_fp8_supported
from meshlm.precision.model_recipe import delayed_formats
from meshlm.precision.quantized_linear import LinearQuantization, QuantizedLinear, keeping_weight_codes
from meshlm.precision.quantized_projections import shares_input_codes
from meshlm.precision.recipes import Recipe

NO_GROUPS = {"input": (), "weight": (), "grad_output": ()}
FP8_CODES = Recipe.fp8_codes

needs_cpu_scaled_mm = pytest.mark.skipif(
    not hardware_fp8_supported("cpu", "tensorwise", out_dtype=torch.bfloat16),
    reason=f"torch {torch.__version__} runs no tensorwise torch._scaled_mm on this CPU")
DEVICES = [pytest.param("cpu", marks=needs_cpu_scaled_mm),
           pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]
"""Where the bit-for-bit checks run: this CPU's _scaled_mm, and a GPU's FP8 GEMM where there is one
(``make test-gpu`` runs this file on CUDA)."""


def projections(recipe, widths=(64, 32, 32), bias=False, hardware=True, history=None, seed=0, device="cpu"):
    """q, k, v-like QuantizedLinear layers of 64 input features in bf16, each with its own
    quantization (its own delayed history where ``recipe`` has one, filled from ``history``)."""
    torch.manual_seed(seed)
    layers = []
    for index, width in enumerate(widths):
        layer = nn.Linear(64, width, bias=bias).to(device=device, dtype=torch.bfloat16)
        layer.__class__ = QuantizedLinear
        delayed = None
        if recipe.name == "fp8_delayed":
            delayed = DelayedScaling(4, torch.device(device), formats=delayed_formats(recipe))
            if history is not None:
                delayed.history.copy_(history)
                delayed.refresh_scales()
                delayed.empty = False
        layer.quantization = LinearQuantization(recipe, index, dict(NO_GROUPS), delayed, hardware=hardware)
        layers.append(layer)
    return layers


def run(layers, x, grads, together: bool):
    """Outputs, the input's gradient and the parameters' gradients of ``layers`` on ``x``."""
    for layer in layers:
        for parameter in layer.parameters():
            parameter.grad = None
    leaf = x.clone().requires_grad_()
    outs = project_together(leaf, tuple(layers)) if together else tuple(layer(leaf) for layer in layers)
    torch.autograd.backward(outs, grads)
    return outs, leaf.grad, [parameter.grad for layer in layers for parameter in layer.parameters()]


def count_casts(monkeypatch):
    """Each call of Recipe.fp8_codes, by role."""
    calls = []

    def counting(self, tensor, role, *args, **kwargs):
        calls.append(role)
        return FP8_CODES(self, tensor, role, *args, **kwargs)

    monkeypatch.setattr(Recipe, "fp8_codes", counting)
    return calls


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("name", ["fp8_tensorwise", "fp8_delayed"])
def test_one_cast_of_the_input_gives_the_separate_layers_numbers(monkeypatch, name, bias, device):
    history = torch.tensor([[5.0, 0.3, 2.0], [7.0, 0.5, 3.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    x = torch.randn(2, 12, 64).to(device=device, dtype=torch.bfloat16)
    grads = [torch.randn(2, 12, width).to(device=device, dtype=torch.bfloat16) for width in (64, 32, 32)]
    results, casts, histories = [], [], []
    for together in (True, False):
        recipe = Recipe(name, fp8_gemm="hardware")
        layers = projections(recipe, bias=bias, history=history, device=device)
        assert shares_input_codes([layer.quantization for layer in layers])
        calls = count_casts(monkeypatch)
        results.append(run(layers, x, grads, together))
        casts.append(calls)
        if name == "fp8_delayed":
            histories.append([layer.quantization.delayed.step_amax.clone() for layer in layers])
    (outs, grad_x, parameter_grads), (outs_apart, grad_x_apart, parameter_grads_apart) = results
    assert all(torch.equal(a, b) for a, b in zip(outs, outs_apart))
    assert all(torch.equal(a, b) for a, b in zip(parameter_grads, parameter_grads_apart))
    # the data gradient's three parts are the same products; only the order of their sum may differ
    torch.testing.assert_close(grad_x, grad_x_apart, rtol=1e-2, atol=1e-2)
    assert casts[0].count("activation") == 1 and casts[1].count("activation") == 3
    assert casts[0].count("weight") == casts[1].count("weight") == 3
    assert casts[0].count("gradient") == casts[1].count("gradient") == 3
    if name == "fp8_delayed":  # every layer recorded the input's amax, as when run apart
        for together_amax, apart_amax in zip(*histories):
            assert torch.equal(together_amax, apart_amax) and together_amax[0] > 0


@needs_cpu_scaled_mm
def test_layers_that_quantize_their_input_differently_run_apart(monkeypatch):
    """The emulated recipe, recipes with block scales, inputs sharded over other groups, a
    delayed history on some layers only: each layer casts its own input."""
    recipe = Recipe("fp8_tensorwise", fp8_gemm="hardware")
    emulated = projections(Recipe("fp8_tensorwise", fp8_gemm="emulated"), hardware=False)
    blockwise = projections(Recipe("fp8_blockwise", fp8_gemm="emulated"), hardware=False)
    other_group = projections(recipe)
    other_group[1].quantization.groups = {**NO_GROUPS, "input": (SimpleNamespace(size=1),)}
    mixed_recipes = projections(recipe)
    mixed_recipes[2].quantization.recipe = Recipe("fp8_tensorwise", fp8_gemm="hardware")
    for layers in (emulated, blockwise, other_group, mixed_recipes):
        assert not shares_input_codes([layer.quantization for layer in layers])
    x = torch.randn(2, 12, 64).to(torch.bfloat16)
    grads = [torch.randn(2, 12, width).to(torch.bfloat16) for width in (64, 32, 32)]
    for layers in (emulated, other_group):
        calls = count_casts(monkeypatch) if layers[0].quantization.hardware else None
        together, apart = run(layers, x, grads, True), run(layers, x, grads, False)
        assert all(torch.equal(a, b) for a, b in zip(together[0], apart[0]))
        if calls is not None:
            assert calls.count("activation") == 6  # three layers, twice each
    assert not shares_input_codes([projections(recipe)[0].quantization])  # one layer: nothing to share


@needs_cpu_scaled_mm
def test_hooked_layer_runs_apart_and_the_rest_is_unchanged(monkeypatch):
    """A forward hook on one projection (as distillation and probing tools add) sends every layer
    through its own forward: the hook sees the layer's output."""
    layers = projections(Recipe("fp8_tensorwise", fp8_gemm="hardware"))
    seen = []
    layers[1].register_forward_hook(lambda module, inputs, output: seen.append(output.shape))
    calls = count_casts(monkeypatch)
    run(layers, torch.randn(2, 12, 64).to(torch.bfloat16),
        [torch.randn(2, 12, width).to(torch.bfloat16) for width in (64, 32, 32)], True)
    assert seen == [torch.Size([2, 12, 32])] and calls.count("activation") == 3


@needs_cpu_scaled_mm
def test_frozen_projections_get_no_weight_gradient():
    layers = projections(Recipe("fp8_tensorwise", fp8_gemm="hardware"))
    for layer in layers:
        layer.weight.requires_grad_(False)
    x = torch.randn(2, 12, 64).to(torch.bfloat16).requires_grad_()
    outs = project_together(x, tuple(layers))
    torch.autograd.backward(outs, [torch.ones_like(out) for out in outs])
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert all(layer.weight.grad is None for layer in layers)


@needs_cpu_scaled_mm
def test_evaluation_does_not_move_the_delayed_histories():
    layers = projections(Recipe("fp8_delayed", fp8_gemm="hardware"),
                         history=torch.tensor([[5.0, 0.3, 2.0]] + [[0.0] * 3] * 3))
    with torch.no_grad():
        outs = project_together(torch.randn(2, 12, 64).to(torch.bfloat16), tuple(layers))
    assert [out.shape[-1] for out in outs] == [64, 32, 32]
    assert all(not layer.quantization.delayed.step_amax.any() for layer in layers)


class Projections(nn.Module):
    """q, k, v-like layers reading one input, and an o-like layer after them: both the shared-input
    path and the single-layer path."""

    def __init__(self, recipe, device="cpu"):
        super().__init__()
        self.qkv = nn.ModuleList(projections(recipe, history=None, device=device))
        self.out = projections(recipe, widths=(64,), seed=1, device=device)[0]

    def forward(self, x):
        q, k, v = project_together(x, tuple(self.qkv))
        return self.out(q * torch.cat([k, v], -1))


def micro_batches(model, inputs, keep: bool):
    """Forward and backward of each of ``inputs`` (a step's micro-batches), accumulating gradients."""
    context = keeping_weight_codes(model) if keep else contextlib.nullcontext()
    with context:
        outs = []
        for x in inputs:
            out = model(x.clone().requires_grad_())
            out.square().mean().backward()
            outs.append(out.detach())
    return outs, [parameter.grad.clone() for parameter in model.parameters()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["fp8_tensorwise", "fp8_delayed"])
def test_weights_cast_once_a_step_give_the_numbers_of_casting_every_micro_batch(monkeypatch, name, device):
    inputs = [torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(seed)).to(device=device,
                                                                                       dtype=torch.bfloat16)
              for seed in range(3)]
    results, casts, amaxes = [], [], []
    for keep in (True, False):
        model = Projections(Recipe(name, fp8_gemm="hardware"), device)
        calls = count_casts(monkeypatch)
        results.append(micro_batches(model, inputs, keep))
        casts.append(calls.count("weight"))
        layers = [*model.qkv, model.out]
        amaxes.append([layer.quantization.delayed.step_amax.clone() for layer in layers]
                      if name == "fp8_delayed" else [])
        assert all(not layer.quantization.keep_weight_codes and layer.quantization.kept_weight_codes is None
                   for layer in layers)  # nothing kept past the step
    (outs, grads), (outs_every, grads_every) = results
    assert all(torch.equal(a, b) for a, b in zip(outs, outs_every))
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_every))
    assert casts == [4, 4 * len(inputs)]  # four weights: once a step, or once a micro-batch
    assert all(torch.equal(a, b) for a, b in zip(*amaxes))


@needs_cpu_scaled_mm
def test_an_optimizer_step_between_steps_is_seen():
    """Kept codes end with the step: the next step (and an evaluation between) casts the updated weights."""
    model = Projections(Recipe("fp8_tensorwise", fp8_gemm="hardware"))
    x = torch.randn(2, 12, 64).to(torch.bfloat16)
    micro_batches(model, [x], keep=True)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(-1)
        flipped = model(x)
    fresh = Projections(Recipe("fp8_tensorwise", fp8_gemm="hardware"))
    with torch.no_grad():
        for parameter, source in zip(fresh.parameters(), model.parameters()):
            parameter.copy_(source)
        assert torch.equal(flipped, fresh(x))
    (kept_out,), _ = micro_batches(model, [x], keep=True)
    assert torch.equal(kept_out, fresh(x).detach())
