"""The experts' grouped GEMMs under every recipe: per expert what a quantized dense layer does, and
the same numbers in one process and under tensor or expert parallelism (fp32, gloo).

*One process.* A grouped linear under a recipe equals, expert by expert, the quantized dense
linear of that expert's rows and weight (same key, so the same stochastic rounding): output, input
gradient and weight gradient. Rows handed over as two sources (two micro-batches arriving at an
expert-parallel rank) equal the two micro-batches run one after the other, weight gradients summed.

*Layouts.* The MoE layer under each recipe at tp 2 (experts split on their FFN width, the sharded
tensors' per-expert amaxes reduced over TP) and at dp 2 x ep 2 (each EP rank's experts receive
both ranks' micro-batches and quantize them apart) against the single process running the global
batch: output, input gradient and every parameter gradient within 1e-5 (a row-parallel sum and
the summed micro-batches change only the summation order). Dropping the TP reduction of the
amaxes, or quantizing an EP rank's rows as one operand, fails the test. An EP group spanning
tensor-parallel ranks is refused.

*Delayed scaling* (``fp8_delayed``): each expert scales from its own window of the stacked
weight's ``[N, E, 3]`` history, or from its current amax while its window is empty (an expert
that has received no tokens yet). In the layouts the second step scales from the first step's
history, and after each step every rank's history is the single process's whole history (under
EP each rank records only its experts; the step's max over data-parallel ranks fills in the rest).

*Hardware FP8 GEMMs* (``precision.fp8_gemm=hardware``; this CPU build of torch runs per-tensor
``torch._scaled_mm``): the grouped GEMMs on FP8 codes equal, expert by expert, the hardware dense
layer, and the emulated grouped GEMMs to fp32 summation order; the layouts hold on them too.
"""

import contextlib
import copy

import pytest
import torch

from meshlm.config import ParallelConfig
from meshlm.errors import ConfigError
from meshlm.models.config import ModelConfig
from meshlm.models.moe.experts import GroupedExperts
from meshlm.models.moe.layer import MoELayer
from meshlm.parallel.collectives import all_reduce_
from meshlm.parallel.expert.expert_parallel import expert_parallel_names
from meshlm.parallel.mesh import build_parallel_context
from meshlm.parallel.parallelize import parallelize_moe_block
from meshlm.parallel.tensor.sharding import gather_full_tensor, reduce_partial_tp_grads
from meshlm.precision.delayed_scaling import DelayedScaling, begin_step, finish_step
from meshlm.precision.formats.fp8 import scale_from_amax
from meshlm.precision.fp8_gemm import hardware_fp8_supported
from meshlm.precision.model_recipe import apply_recipe, delayed_formats, quantize_experts
from meshlm.precision.quantized_experts import GroupedQuantization
from meshlm.precision.quantized_linear import LinearQuantization, quantized_linear
from meshlm.precision.recipes import RECIPES, Recipe
from tests.helpers.distributed import run_distributed
from tests.helpers.parallel_checks import assert_all_within_tolerance, seeded
from tests.helpers.scaled_mm import record_fast_accumulation

QUANTIZED = [name for name in RECIPES if name != "none"]
PER_TENSOR_FP8 = ["fp8_tensorwise", "fp8_delayed"]
NO_GROUPS = {"input": (), "weight": (), "grad_output": ()}
CPU_SCALED_MM = hardware_fp8_supported("cpu", "tensorwise", out_dtype=torch.float32)
needs_cpu_scaled_mm = pytest.mark.skipif(not CPU_SCALED_MM, reason=f"torch {torch.__version__} runs no tensorwise "
                                                                   "torch._scaled_mm on this CPU")
TOLERANCE = 1e-5
BATCH, SEQ, HIDDEN = 2, 16, 32


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach(), expected.detach()
    scale = expected.abs().max()
    difference = (actual - expected).abs().max()
    return float(difference / scale) if scale > 0 else float(difference)


def reduce_max(tensor: torch.Tensor, group) -> None:
    all_reduce_(tensor, group, op="max")


# --- one process ---------------------------------------------------------------------------------------

def grouped_case(recipe: Recipe, rows: list[int]):
    tokens = seeded(sum(rows), 64, seed=1).requires_grad_()
    weight = (0.1 * seeded(len(rows), 48, 64, seed=2)).requires_grad_()
    upstream = seeded(sum(rows), 48, seed=3)
    return tokens, weight, upstream


HARDWARE_CASES = [pytest.param(name, "hardware", marks=needs_cpu_scaled_mm) for name in PER_TENSOR_FP8]


@pytest.mark.parametrize("name, fp8_gemm", [(name, "emulated") for name in QUANTIZED] + HARDWARE_CASES)
def test_grouped_linear_is_a_quantized_dense_layer_per_expert(name, fp8_gemm):
    recipe, rows = Recipe(name, seed=7, step=3, fp8_gemm=fp8_gemm), [40, 0, 17, 64]  # an expert without rows, a ragged one
    tokens, weight, upstream = grouped_case(recipe, rows)
    keys = [11, 22, 33, 44]
    grouped = GroupedQuantization(recipe, keys, NO_GROUPS, hardware=fp8_gemm == "hardware")
    out = grouped.linear(tokens, weight, torch.tensor(rows))
    (out * upstream).sum().backward()

    reference_tokens, reference_weight = tokens.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    pieces = [quantized_linear(x, reference_weight[e], None, recipe, key=keys[e]) if len(x) else x @ reference_weight[e].t()
              for e, x in enumerate(reference_tokens.split(rows))]
    expected = torch.cat(pieces)
    (expected * upstream).sum().backward()
    assert relative_error(out, expected) <= 1e-6
    assert relative_error(tokens.grad, reference_tokens.grad) <= 1e-6
    assert relative_error(weight.grad, reference_weight.grad) <= 1e-6
    assert relative_error(out, tokens.detach().matmul(weight.detach()[0].t())) > 0  # it did quantize


@pytest.mark.parametrize("name", QUANTIZED)
def test_rows_from_two_sources_quantize_like_two_micro_batches(name):
    recipe = Recipe(name, seed=7, step=3)
    per_source = torch.tensor([[9, 20], [30, 5], [0, 12]])  # [experts, sources]
    groups = NO_GROUPS
    tokens, weight, upstream = grouped_case(recipe, per_source.sum(1).tolist())
    second_source = torch.tensor([0.0, 1.0]).repeat(3).repeat_interleave(per_source.flatten()).bool()
    with torch.no_grad():  # small tokens from one source, small gradients for the other: shared scales would differ
        tokens[second_source] *= 1e-3
        upstream[~second_source] *= 1e-3
    grouped = GroupedQuantization(recipe, [1, 2, 3], groups)
    out = grouped.linear(tokens, weight, per_source.sum(1), per_source)
    (out * upstream).sum().backward()

    segments = per_source.flatten().tolist()  # rows in (expert, source) order
    order = [index for source in range(2) for index in range(source, len(segments), 2)]  # the sources' rows, each in expert order
    reference_weight = weight.detach().clone().requires_grad_()
    outputs, input_grads = [None] * len(segments), [None] * len(segments)
    token_pieces, upstream_pieces = tokens.detach().split(segments), upstream.split(segments)
    for source in range(2):
        mine = order[source * 3:(source + 1) * 3]
        x = torch.cat([token_pieces[i] for i in mine]).requires_grad_()
        y = grouped.linear(x, reference_weight, per_source[:, source])
        (y * torch.cat([upstream_pieces[i] for i in mine])).sum().backward()
        for i, piece, grad in zip(mine, y.split(per_source[:, source].tolist()), x.grad.split(per_source[:, source].tolist())):
            outputs[i], input_grads[i] = piece, grad
    assert relative_error(out, torch.cat(outputs)) <= 1e-6
    assert relative_error(tokens.grad, torch.cat(input_grads)) <= 1e-6
    assert relative_error(weight.grad, reference_weight.grad) <= 1e-6
    merged_weight = weight.detach().clone().requires_grad_()  # one operand per expert: other scales or tiles
    merged = GroupedQuantization(recipe, [1, 2, 3], groups).linear(tokens.detach(), merged_weight, per_source.sum(1))
    (merged * upstream).sum().backward()
    assert relative_error(merged_weight.grad, reference_weight.grad) > 1e-4


def grouped_run(grouped: GroupedQuantization, tokens, weight, upstream, rows) -> list[torch.Tensor]:
    """Output, input gradient and weight gradient of one training step of ``grouped``."""
    tokens, weight = tokens.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    out = grouped.linear(tokens, weight, torch.tensor(rows))
    return [out.detach(), *torch.autograd.grad((out * upstream).sum(), (tokens, weight))]


@needs_cpu_scaled_mm
@pytest.mark.parametrize("name", PER_TENSOR_FP8)
def test_hardware_grouped_gemms_compute_what_the_emulation_computes(name):
    """The same quantized operands multiplied as FP8 codes (torch._scaled_mm, fp32 accumulation)
    or as dequantized fp32 tensors: equal to fp32 summation order."""
    rows = [40, 0, 17, 64]
    tokens, weight, upstream = grouped_case(Recipe(name), rows)
    hardware = grouped_run(GroupedQuantization(Recipe(name, fp8_gemm="hardware"), [1, 2, 3, 4], NO_GROUPS,
                                               hardware=True), tokens, weight, upstream, rows)
    emulated = grouped_run(GroupedQuantization(Recipe(name, fp8_gemm="emulated"), [1, 2, 3, 4], NO_GROUPS),
                           tokens, weight, upstream, rows)
    for actual, expected in zip(hardware, emulated):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    plain = torch.cat([x @ weight[e].detach().t() for e, x in enumerate(tokens.detach().split(rows))])
    assert 0 < (hardware[0] - plain).abs().max() < 0.1 * plain.abs().max()  # quantized, and close


@needs_cpu_scaled_mm
def test_experts_accumulate_fast_in_their_forward_gemms_only(monkeypatch):
    """The experts' hardware GEMMs follow precision.fp8_fast_accumulation as the dense layers do:
    under the default 'fprop' each segment's forward product keeps its sums in the tensor cores,
    and the data- and weight-gradient products split their accumulator."""
    rows = [40, 0, 17, 64]
    tokens, weight, upstream = grouped_case(Recipe("fp8_tensorwise"), rows)
    grouped = GroupedQuantization(Recipe("fp8_tensorwise", fp8_gemm="hardware"), [1, 2, 3, 4], NO_GROUPS, hardware=True)
    calls = record_fast_accumulation(monkeypatch)
    tokens, weight = tokens.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    out = grouped.linear(tokens, weight, torch.tensor(rows))
    forward_calls = list(calls)
    torch.autograd.grad((out * upstream).sum(), (tokens, weight))
    assert forward_calls == [True] * 3  # one product per expert with tokens
    assert calls[3:] == [False] * 6  # dgrad and wgrad, per expert with tokens


class StackedWeight(torch.nn.Module):
    """What ``delayed_scaling.begin_step`` / ``finish_step`` look for: a module with ``quantizations``."""

    def __init__(self, grouped: GroupedQuantization):
        super().__init__()
        self.quantizations = {"up_weight": grouped}


@pytest.mark.parametrize("fp8_gemm", ["emulated", pytest.param("hardware", marks=needs_cpu_scaled_mm)])
def test_delayed_scaling_keeps_a_history_per_expert(fp8_gemm):
    """Step 1 (empty histories) is current scaling; its per-expert amaxes fill column e of the
    ``[N, E, 3]`` history, and step 2 scales expert e from them -- except where e's window is
    still empty (expert 1 had no tokens at step 1: its input and output gradient scale from their
    current amax at step 2, its weight from the window). Filled experts equal a dense fp8_delayed
    layer holding the same history."""
    recipe = Recipe("fp8_delayed", fp8_gemm=fp8_gemm)
    hardware = fp8_gemm == "hardware"
    grouped = GroupedQuantization(recipe, [1, 2, 3, 4], NO_GROUPS, hardware=hardware,
                                  delayed=DelayedScaling(4, torch.device("cpu"), 4, formats=delayed_formats(recipe)))
    holder = StackedWeight(grouped)
    first_rows, second_rows = [40, 0, 17, 64], [0, 30, 9, 25]
    tokens, weight, upstream = grouped_case(recipe, first_rows)
    begin_step(holder)
    first = grouped_run(grouped, tokens, weight, upstream, first_rows)
    current = grouped_run(GroupedQuantization(Recipe("fp8_tensorwise", fp8_gemm=fp8_gemm), [1, 2, 3, 4], NO_GROUPS,
                                              hardware=hardware), tokens, weight, upstream, first_rows)
    assert all(torch.equal(a, b) for a, b in zip(first, current))
    finish_step(holder)
    history = grouped.delayed.history
    pieces = tokens.detach().split(first_rows)
    grads = upstream.split(first_rows)
    amax = lambda tensor: tensor.abs().max() if tensor.numel() else torch.tensor(0.0)  # noqa: E731
    for expert in range(4):  # input, weight, output gradient
        assert history[0, expert].tolist() == [amax(pieces[expert]), amax(weight[expert].detach()),
                                               amax(grads[expert])], expert
    assert (history[1:] == 0).all()

    tokens2, _, upstream2 = grouped_case(recipe, second_rows)
    tokens2 = 3 * tokens2  # amaxes beyond the window: a delayed scale saturates where current scaling would not
    begin_step(holder)
    assert grouped.delayed.filled == [[True, True, True], [False, True, False], [True, True, True],
                                      [True, True, True]]
    second = grouped_run(grouped, tokens2, weight, upstream2, second_rows)
    window = history.amax(0)
    quantize = recipe.quantize
    out_pieces = second[0].split(second_rows)
    for expert, x in enumerate(tokens2.split(second_rows)):
        if not len(x):
            continue
        input_scale = (scale_from_amax(window[expert, 0]) if expert != 1 else scale_from_amax(x.abs().max()))
        expected = quantize(x, "activation", scale=input_scale) @ quantize(
            weight[expert].detach(), "weight", scale=scale_from_amax(window[expert, 1])).t()
        torch.testing.assert_close(out_pieces[expert], expected, rtol=1e-5, atol=1e-5)
    for expert in (2, 3):  # filled windows: a dense fp8_delayed layer with expert e's history
        dense = DelayedScaling(4, torch.device("cpu"), formats=delayed_formats(recipe))
        dense.history.copy_(history[:, expert])
        dense.refresh_scales()
        dense.empty = False
        layer = LinearQuantization(recipe, 2 + expert, NO_GROUPS, dense, hardware=hardware)
        x = tokens2.split(second_rows)[expert].clone().requires_grad_()
        w = weight[expert].detach().clone().requires_grad_()
        out = layer.linear(x, w, None)
        expected = [out.detach(), *torch.autograd.grad((out * upstream2.split(second_rows)[expert]).sum(), (x, w))]
        actual = [second[0].split(second_rows)[expert], second[1].split(second_rows)[expert], second[2][expert]]
        for got, want in zip(actual, expected):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_apply_recipe_quantizes_the_experts_of_chosen_blocks():
    config = ModelConfig(hidden_size=32, pattern="E*E", vocab_size=64, moe_num_experts=4, moe_top_k=2,
                         moe_ffn_hidden_size=32, num_attention_heads=4)
    from meshlm.models.language_model import LanguageModel
    model = LanguageModel(config)
    apply_recipe(model, Recipe("nvfp4"), num_blocks=3, high_precision_layers=1)
    experts = [module for module in model.modules() if isinstance(module, GroupedExperts)]
    assert [module.quantizations is not None for module in experts] == [False, False]  # blocks 0 and 2 kept
    apply_recipe(model, Recipe("nvfp4"), num_blocks=3)
    assert all(set(module.quantizations) == {"gate_weight", "up_weight", "down_weight"} for module in experts)
    tokens = torch.randint(0, 64, (2, 16))
    model(tokens, labels=tokens).loss.backward()
    assert all(torch.isfinite(module.up_weight.grad).all() for module in experts)


# --- layouts ---------------------------------------------------------------------------------------

def make_config(ffn: int) -> ModelConfig:
    return ModelConfig(hidden_size=HIDDEN, pattern="E", vocab_size=64, moe_num_experts=4, moe_top_k=2,
                       moe_ffn_hidden_size=ffn, init_std=0.2)


def reduce_like_the_trainer(model: torch.nn.Module, context) -> None:
    reduce_partial_tp_grads(model, context)
    experts = expert_parallel_names(model)
    for name, param in model.named_parameters():
        all_reduce_(param.grad, context.edp_group if name in experts else context.dp_cp_group)


def history_of(layer: MoELayer, weight_name: str) -> torch.Tensor:
    return layer.experts.quantizations[weight_name].delayed.history


def layout_errors(layout: dict, name: str, ffn: int, break_it: str = "", fp8_gemm: str = "emulated") -> dict:
    """Relative errors of the parallel MoE layer against one process, for each step (fp8_delayed:
    two, the second scaling from the first's history, whose every entry is compared too)."""
    context = build_parallel_context(ParallelConfig(**layout), make_config(ffn), torch.device("cpu"))
    recipe = Recipe(name, seed=5, step=1, fp8_gemm=fp8_gemm)
    torch.manual_seed(0)
    reference = MoELayer(make_config(ffn))
    with torch.no_grad():
        for index, param in enumerate(reference.parameters()):
            param.add_(0.1 * seeded(*param.shape, seed=100 + index))
    parallel = parallelize_moe_block(copy.deepcopy(reference), context)
    quantize_experts(reference.experts, recipe, "0.mixer.experts")
    quantize_experts(parallel.experts, recipe, "0.mixer.experts", context, reduce_max)
    if break_it == "no tp reduction":
        for quantization in parallel.experts.quantizations.values():
            quantization.groups = NO_GROUPS
    if break_it == "one operand per expert":
        parallel.experts.forward = lambda rows, counts, per_source=None: GroupedExperts.forward(parallel.experts, rows, counts)
    if break_it == "no dp history reduction":
        context.dp_group = None

    errors = {}
    for step in range(2 if name == "fp8_delayed" else 1):
        label = f"step {step + 1} " if name == "fp8_delayed" else ""
        inputs = [seeded(BATCH, SEQ, HIDDEN, seed=10 + d + 100 * step) for d in range(context.dp_size)]
        upstreams = [seeded(BATCH, SEQ, HIDDEN, seed=20 + d + 100 * step) for d in range(context.dp_size)]
        for layer in (reference, parallel):
            layer.zero_grad()
            begin_step(layer)
        for index, (x, upstream) in enumerate(zip(inputs, upstreams)):  # the global batch, one micro-batch at a time
            x = x.clone().requires_grad_()
            out, _ = reference(x, None)
            (out * upstream).sum().backward()
            if index == context.dp_rank:
                expected, expected_grad = out.detach(), x.grad
        local = inputs[context.dp_rank].clone().requires_grad_()
        out, _ = parallel(local, None)
        (out * upstreams[context.dp_rank]).sum().backward()
        reduce_like_the_trainer(parallel, context)
        finish_step(reference)
        finish_step(parallel, (context.tp_group, context.dp_group), reduce_max)  # as the trainer does
        expected_params = dict(reference.named_parameters())
        errors[f"{label}output"] = relative_error(out, expected)
        errors[f"{label}input grad"] = relative_error(local.grad, expected_grad)
        for param_name, param in parallel.named_parameters():
            full = gather_full_tensor(param, param.grad, context)
            errors[f"{label}grad {param_name}"] = relative_error(full, expected_params[param_name].grad)
        if name == "fp8_delayed":
            for weight_name in parallel.experts.quantizations:
                errors[f"{label}history {weight_name}"] = relative_error(history_of(parallel, weight_name),
                                                                         history_of(reference, weight_name))
    return errors


LAYOUT_CASES = [(label, layout, ffn, name, "emulated") for label, layout, ffn in
                (("tp2", dict(tp=2), 256), ("dp2 ep2", dict(ep=2), 32)) for name in QUANTIZED]
if CPU_SCALED_MM:  # the hardware GEMMs on FP8 codes, per-tensor recipes (this CPU has no block-scaled GEMM)
    LAYOUT_CASES += [(f"{label} hardware", layout, ffn, name, "hardware") for label, layout, ffn in
                     (("tp2", dict(tp=2), 256), ("dp2 ep2", dict(ep=2), 32)) for name in PER_TENSOR_FP8]


def run_layouts(break_it: str = "") -> dict:
    errors = {}
    for label, layout, ffn, name, fp8_gemm in LAYOUT_CASES:
        skip = {"no tp reduction": not label.startswith("tp2"), "one operand per expert": label.startswith("tp2"),
                "no dp history reduction": name != "fp8_delayed" or not label.startswith("dp2")}
        if skip.get(break_it, False):
            continue
        for quantity, error in layout_errors(layout, name, ffn, break_it, fp8_gemm).items():
            errors[f"{label} {name}: {quantity}"] = error
    return errors


def expected_count() -> int:
    """Output, input grad and 4 parameter gradients a step; fp8_delayed: 2 steps and 3 histories."""
    return sum(2 * (6 + 3) if name == "fp8_delayed" else 6 for *_, name, _ in LAYOUT_CASES)


def test_expert_layouts_quantize_like_one_process():
    every_rank = run_distributed(run_layouts, 2)
    assert all(len(errors) == expected_count() for errors in every_rank)
    assert_all_within_tolerance(every_rank, TOLERANCE)


@pytest.mark.parametrize("break_it", ["no tp reduction", "one operand per expert", "no dp history reduction"])
def test_expert_layout_check_fails_when_broken(break_it):
    every_rank = run_distributed(run_layouts, 2, break_it)
    assert any(error > TOLERANCE for errors in every_rank for error in errors.values())


def refuse_ep_over_tp() -> str:
    context = build_parallel_context(ParallelConfig(tp=2, sp=True, ep=2, etp=1), make_config(32), torch.device("cpu"))
    layer = parallelize_moe_block(MoELayer(make_config(32)), context)
    with pytest.raises(ConfigError) as error:
        quantize_experts(layer.experts, Recipe("fp8_tensorwise"), "3.mixer.experts", context, reduce_max)
    return str(error.value)


def test_expert_parallel_over_tensor_parallel_ranks_is_refused():
    message = run_distributed(refuse_ep_over_tp, 2)[0]
    assert "parallel.tp=2" in message and "3.mixer.experts" in message and "parallel.ep" in message


@needs_cpu_scaled_mm
@pytest.mark.parametrize("name", PER_TENSOR_FP8)
def test_expert_weights_cast_once_a_step_give_the_numbers_of_casting_every_micro_batch(monkeypatch, name):
    """Inside ``keeping_weight_codes`` (the trainer's step) each expert's weight is cast on the first
    micro-batch and its codes read by the others: the same outputs, gradients and delayed-scaling
    amaxes, bit for bit, as casting at every micro-batch."""
    from meshlm.precision.quantized_linear import keeping_weight_codes

    config = ModelConfig(hidden_size=64, moe_num_experts=4, moe_ffn_hidden_size=48, mlp_activation="swiglu")
    micro_batches = [(seeded(20, 64, seed=10 + index).to(torch.bfloat16), torch.tensor(rows))
                     for index, rows in enumerate([[5, 0, 7, 8], [0, 12, 4, 4], [6, 6, 6, 2]])]
    original, results, casts = Recipe.fp8_codes, [], []
    for keep in (True, False):
        torch.manual_seed(0)
        experts = GroupedExperts(config, 64).to(torch.bfloat16)
        quantize_experts(experts, Recipe(name, fp8_gemm="hardware"), "1.mixer.experts")
        roles = []
        monkeypatch.setattr(Recipe, "fp8_codes", lambda self, tensor, role, *args, **kwargs:
                            roles.append(role) or original(self, tensor, role, *args, **kwargs))
        with keeping_weight_codes(experts) if keep else contextlib.nullcontext():
            outs = []
            for tokens, counts in micro_batches:
                out = experts(tokens.clone().requires_grad_(), counts)
                out.float().square().mean().backward()
                outs.append(out.detach())
        amaxes = [grouped.delayed.step_amax.clone() for grouped in experts.quantizations.values()
                  if grouped.delayed is not None]
        results.append((outs, [parameter.grad.clone() for parameter in experts.parameters()], amaxes))
        casts.append(roles.count("weight"))
        assert all(grouped.kept_weight_codes is None for grouped in experts.quantizations.values())
    for kept, every in zip(*results):
        assert all(torch.equal(a, b) for a, b in zip(kept, every))
    weights = 3 * 4 * 2  # gate, up and down of 4 experts, forward and transposed codes
    assert casts == [weights, weights * len(micro_batches)]
