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
"""

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
from meshlm.precision.model_recipe import apply_recipe, quantize_experts
from meshlm.precision.quantized_experts import GroupedQuantization
from meshlm.precision.quantized_linear import quantized_linear
from meshlm.precision.recipes import RECIPES, Recipe
from tests.helpers.distributed import run_distributed
from tests.helpers.parallel_checks import assert_all_within_tolerance, seeded

QUANTIZED = [name for name in RECIPES if name != "none"]
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


@pytest.mark.parametrize("name", QUANTIZED)
def test_grouped_linear_is_a_quantized_dense_layer_per_expert(name):
    recipe, rows = Recipe(name, seed=7, step=3), [40, 0, 17, 64]  # an expert without rows, a ragged one
    tokens, weight, upstream = grouped_case(recipe, rows)
    keys = [11, 22, 33, 44]
    grouped = GroupedQuantization(recipe, keys, {"input": (), "weight": (), "grad_output": ()})
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
    groups = {"input": (), "weight": (), "grad_output": ()}
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


def layout_errors(layout: dict, name: str, ffn: int, break_it: str = "") -> dict:
    context = build_parallel_context(ParallelConfig(**layout), make_config(ffn), torch.device("cpu"))
    recipe = Recipe(name, seed=5, step=1)
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
            quantization.groups = {"input": (), "weight": (), "grad_output": ()}
    if break_it == "one operand per expert":
        parallel.experts.forward = lambda rows, counts, per_source=None: GroupedExperts.forward(parallel.experts, rows, counts)

    inputs = [seeded(BATCH, SEQ, HIDDEN, seed=10 + d) for d in range(context.dp_size)]
    upstreams = [seeded(BATCH, SEQ, HIDDEN, seed=20 + d) for d in range(context.dp_size)]
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
    expected_params = dict(reference.named_parameters())
    errors = {"output": relative_error(out, expected), "input grad": relative_error(local.grad, expected_grad)}
    for param_name, param in parallel.named_parameters():
        full = gather_full_tensor(param, param.grad, context)
        errors[f"grad {param_name}"] = relative_error(full, expected_params[param_name].grad)
    return errors


def run_layouts(break_it: str = "") -> dict:
    errors = {}
    for label, layout, ffn in (("tp2", dict(tp=2), 256), ("dp2 ep2", dict(ep=2), 32)):
        for name in QUANTIZED:
            if break_it == "no tp reduction" and label != "tp2" or break_it == "one operand per expert" and label == "tp2":
                continue
            for quantity, error in layout_errors(layout, name, ffn, break_it).items():
                errors[f"{label} {name}: {quantity}"] = error
    return errors


def test_expert_layouts_quantize_like_one_process():
    every_rank = run_distributed(run_layouts, 2)
    assert all(len(errors) == 2 * len(QUANTIZED) * 6 for errors in every_rank)  # output, input grad, 4 params
    assert_all_within_tolerance(every_rank, TOLERANCE)


@pytest.mark.parametrize("break_it", ["no tp reduction", "one operand per expert"])
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
