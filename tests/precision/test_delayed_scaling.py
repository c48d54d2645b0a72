"""Delayed scaling's state (meshlm/precision/delayed_scaling.py): each operand's scale is made from
its window whenever the history moves, bit for bit the scale of ``scale_from_amax`` in the format
the recipe gives that operand, so the GEMMs of a step read it instead of reducing the window."""

import pytest
import torch
from torch import nn

from meshlm.precision.delayed_scaling import OPERANDS, DelayedScaling, begin_step, finish_step
from meshlm.precision.formats.fp8 import scale_from_amax
from meshlm.precision.model_recipe import delayed_formats
from meshlm.precision.quantized_linear import ROLES, LinearQuantization
from meshlm.precision.recipes import Recipe

CPU = torch.device("cpu")


@pytest.mark.parametrize("fp8_format", ["hybrid", "e4m3"])
@pytest.mark.parametrize("num_experts", [0, 3])
def test_scales_are_scale_from_amax_of_the_window_in_each_operands_format(fp8_format, num_experts):
    recipe = Recipe("fp8_delayed", fp8_format)
    state = DelayedScaling(5, CPU, num_experts, formats=delayed_formats(recipe))
    generator = torch.Generator().manual_seed(0)
    state.history.copy_(torch.exp(torch.randn(state.history.shape, generator=generator) * 8))
    state.history[:, ..., 1] = 0  # an operand never seen: scale 1
    state.refresh_scales()
    for operand in OPERANDS:
        expected = scale_from_amax(state.window_amax(operand), recipe.fp8_format_of(ROLES[operand]))
        assert torch.equal(state.scale(operand), expected), operand
    assert (state.scale("weight") == 1).all()
    assert delayed_formats(recipe)[2].name == ("e5m2" if fp8_format == "hybrid" else "e4m3")


class OneLayer(nn.Module):
    """What begin_step and finish_step walk: a module holding a ``quantization``."""

    def __init__(self, quantization):
        super().__init__()
        self.quantization = quantization


def test_scales_move_with_the_history_at_every_step_boundary():
    """begin_step makes them from a history loaded in place (a resumed run), finish_step from the
    window the step has just pushed (an evaluation before the next step scales from it)."""
    recipe = Recipe("fp8_delayed")
    state = DelayedScaling(4, CPU, formats=delayed_formats(recipe))
    layer = OneLayer(LinearQuantization(recipe, 0, {name: () for name in OPERANDS}, state))
    state.history[2] = torch.tensor([448.0, 896.0, 57344.0])  # as a checkpoint restores it
    begin_step(layer)
    assert not state.empty and [state.scale(operand).item() for operand in OPERANDS] == [1.0, 2.0, 1.0]
    state.record("input", torch.tensor(4480.0))
    finish_step(layer)
    assert [state.scale(operand).item() for operand in OPERANDS] == [10.0, 2.0, 1.0]


def test_one_format_per_operand_is_required():
    with pytest.raises(ValueError, match="formats: one FP8 format per operand"):
        DelayedScaling(4, CPU, formats=delayed_formats(Recipe("fp8_delayed"))[:2])


@pytest.mark.parametrize("fp8_gemm", ["emulated", "hardware"])
def test_evaluation_under_no_grad_records_no_amax(fp8_gemm):
    """The trainer evaluates under ``torch.no_grad``, where an autograd function's forward still
    sees ``needs_input_grad`` True for the parameters: the amaxes of a validation pass must not
    enter the next step's history (nor, so, a resumed run's). A training forward does record."""
    from meshlm.precision.fp8_gemm import hardware_fp8_supported
    from meshlm.precision.model_recipe import quantize_experts, quantize_layer
    from meshlm.precision.quantized_linear import QuantizedLinear
    from meshlm.models.moe.experts import GroupedExperts

    if fp8_gemm == "hardware" and not hardware_fp8_supported("cpu", "tensorwise", out_dtype=torch.float32):
        pytest.skip(f"torch {torch.__version__} runs no tensorwise torch._scaled_mm on this CPU")
    recipe = Recipe("fp8_delayed", fp8_gemm=fp8_gemm)
    layer = nn.Linear(32, 16)
    layer.__class__ = QuantizedLinear
    quantize_layer(layer, recipe, "0.mixer.q_proj")
    from meshlm.models.config import ModelConfig

    config = ModelConfig(hidden_size=32, moe_num_experts=4, moe_ffn_hidden_size=16, mlp_activation="swiglu")
    experts = GroupedExperts(config, 32)
    quantize_experts(experts, recipe, "1.mixer.experts")
    histories = [layer.quantization.delayed, *(grouped.delayed for grouped in experts.quantizations.values())]
    tokens, counts = torch.randn(8, 32), torch.tensor([3, 0, 5, 0])
    with torch.no_grad():
        layer(torch.randn(2, 8, 32))
        experts(tokens, counts)
    assert all(not state.step_amax.any() for state in histories)
    layer(torch.randn(2, 8, 32)).sum().backward()
    experts(tokens, counts).sum().backward()
    assert all(state.step_amax[..., 0].max() > 0 for state in histories)  # the inputs' amaxes


@pytest.mark.parametrize("num_experts", [0, 3])
def test_each_operands_scale_starts_a_storage_of_its_own(num_experts):
    """A layer's scales go to ``torch._scaled_mm`` as they are inside a compiled graph, where a view
    4 or 8 bytes into a shared storage (the columns of one tensor, as they were) made Inductor's
    lowering fail on an H200 and the block run eagerly; refreshed in place, they stay those tensors."""
    state = DelayedScaling(4, CPU, num_experts, formats=delayed_formats(Recipe("fp8_delayed")))
    before = [state.scale(operand) for operand in OPERANDS]
    state.history[0] = 448.0
    state.refresh_scales()
    for operand, tensor in zip(OPERANDS, before):
        scale = state.scale(operand)
        assert scale is tensor and scale.storage_offset() == 0 and scale.is_contiguous(), operand
        assert scale.untyped_storage().nbytes() == scale.numel() * 4, operand
        assert scale.shape == ((num_experts,) if num_experts else ()), operand
