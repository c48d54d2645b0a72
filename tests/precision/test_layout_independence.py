"""Low-precision recipes quantize exactly as one process does, whatever the layout (fp32, gloo).

*Layers* (the exact statement). Two spawned ranks hold a column-parallel and a row-parallel
linear layer cut from one full layer (tp 2, sequence parallelism off and on), and a plain layer
whose tokens are split into context-parallel chunks (cp 2). Fed the shards of the same input and
output gradient as the full layer, under every recipe, for two steps (fp8_delayed's second step
scales from the history reduced over the group), every GEMM operand a rank quantizes is bitwise
the matching piece of the single-process operand, so the output, the input gradient and the
weight gradient agree to the GEMMs' summation order (1e-6). That needs per-tensor amaxes
reduced over the group (weights, row-parallel inputs, column-parallel output gradients and
every tensor under CP are shards), blocks that never straddle ranks, and stochastic-rounding
noise that depends on the values, not on the rank.

*Models* (the wiring). A dense and a hybrid Mamba-2 model at tp 2 (its fused in_proj cut in five
partitions per rank) against one process: losses within 1e-5 and gradients within 1e-4. Exact
equality is not to be had there: a row-parallel layer's output is a sum over ranks in another
order, and an input 1e-7 away from a rounding boundary of the format lands on the other side;
the flipped element then differs by one step of the format. FP8's steps are fine enough for
1e-4 over two steps; NVFP4's are not (one flipped E2M1 element moves a gradient by ~1e-2), so
NVFP4 is checked at the layer level only. A recipe whose blocks would straddle the ranks
(NVFP4 on the hybrid's 4 dt rows per rank) is refused, naming the layer. On the CPU's FP8 GEMM
the per-tensor recipes share q, k and v's input cast, and a step of two micro-batches keeping
each weight's codes (``keeping_weight_codes``) equals the same step casting them every
micro-batch bit for bit at tp 2, and one process within the same bounds.
"""

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from meshlm.config import ParallelConfig
from meshlm.errors import ConfigError
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel
from meshlm.parallel.mesh import build_parallel_context
from meshlm.parallel.parallelize import parallelize_model
from meshlm.parallel.context.chunks import paired_chunks
from meshlm.parallel.collectives import all_reduce_
from meshlm.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from meshlm.parallel.tensor.sharding import gather_full_tensor, reduce_partial_tp_grads
from meshlm.precision.delayed_scaling import begin_step, finish_step
from meshlm.precision.fp8_gemm import hardware_fp8_supported
from meshlm.precision.model_recipe import apply_recipe, quantize_layer
from meshlm.precision.quantized_linear import QuantizedLinear, keeping_weight_codes
from meshlm.precision.recipes import RECIPES, Recipe
from tests.helpers.distributed import run_distributed
from tests.helpers.parallel_checks import seeded


def reduce_max(tensor: torch.Tensor, group) -> None:
    all_reduce_(tensor, group, op="max")

LAYER_TOLERANCE = 1e-6
LOSS_TOLERANCE, GRAD_TOLERANCE = 1e-5, 1e-4
BATCH, SEQ, VOCAB = 2, 32, 64
FEATURES, LAYER_SEQ = 256, 64  # a tp 2 shard of 128 features holds whole 128-wide blocks; cp 2 chunks of 16 tokens


# --- layers -----------------------------------------------------------------------------------------

def layer_steps(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The full input [2, LAYER_SEQ, FEATURES] and output gradient of step ``step``."""
    return seeded(2, LAYER_SEQ, FEATURES, seed=10 + step), seeded(2, LAYER_SEQ, FEATURES, seed=20 + step)


def full_linear() -> nn.Linear:
    layer = nn.Linear(FEATURES, FEATURES, bias=False)
    with torch.no_grad():
        layer.weight.copy_(seeded(FEATURES, FEATURES, seed=5) * 0.05)
    return layer


def run_layer(layer, recipe: Recipe, inputs_of, grad_of, groups=()) -> list[tuple]:
    """(output, input gradient, weight gradient) of two steps; ``inputs_of`` / ``grad_of`` cut the
    full tensors into what this rank holds."""
    results = []
    for step in range(2):
        recipe.step = step
        begin_step(layer)
        full_inputs, full_grad = layer_steps(step)
        inputs = inputs_of(full_inputs).clone().requires_grad_()
        out = layer(inputs)
        out.backward(grad_of(full_grad))
        finish_step(layer, groups, reduce_max)
        results.append((out.detach(), inputs.grad, layer.weight.grad.clone()))
        layer.weight.grad = None
    return results


def tensor_parallel_layers(context, name: str) -> dict:
    """{case: [(output, input grad, weight grad) per step]} of a column- and a row-parallel layer,
    each as the single process would hold them (the pieces of the full tensors)."""
    rank, half = context.tp_rank, FEATURES // 2
    features = slice(rank * half, (rank + 1) * half)
    tokens = slice(rank * LAYER_SEQ // 2, (rank + 1) * LAYER_SEQ // 2)
    sp = context.sequence_parallel
    sequence = (lambda t: t[:, tokens]) if sp else (lambda t: t)
    column, row = ColumnParallelLinear.from_full(full_linear(), context), RowParallelLinear.from_full(full_linear(), context)
    recipe = Recipe(name, seed=3)
    quantize_layer(column, recipe, "column", context, reduce_max)
    quantize_layer(row, recipe, "row", context, reduce_max)
    cases = {}
    cases["column"] = [(out, dx if sp else dx, dw) for out, dx, dw in
                       run_layer(column, recipe, sequence, lambda g: g[..., features], (context.tp_group,))]
    cases["row"] = run_layer(row, recipe, lambda x: x[..., features], sequence, (context.tp_group,))
    return cases


def expected_pieces(reference: list[tuple], case: str, context) -> list[tuple]:
    """The pieces of the single-process results a rank of ``case`` should hold."""
    rank, half = context.tp_rank, FEATURES // 2
    features = slice(rank * half, (rank + 1) * half)
    tokens = slice(rank * LAYER_SEQ // 2, (rank + 1) * LAYER_SEQ // 2)
    sequence = (lambda t: t[:, tokens]) if context.sequence_parallel else (lambda t: t)
    if case == "column":
        return [(out[..., features], sequence(dx), dw[features]) for out, dx, dw in reference]
    return [(sequence(out), dx[..., features], dw[:, features]) for out, dx, dw in reference]


def context_parallel_positions(context) -> torch.Tensor:
    """The sequence positions this CP rank holds (its two paired chunks)."""
    chunk = LAYER_SEQ // (2 * context.cp_size)
    return torch.cat([torch.arange(index * chunk, (index + 1) * chunk)
                      for index in paired_chunks(context.cp_rank, context.cp_size)])


def run_layer_cases() -> dict:
    errors = {}
    config = ModelConfig(vocab_size=VOCAB, hidden_size=64, pattern="*-", num_attention_heads=4)
    contexts = {f"tp2 sp={sp}": build_parallel_context(ParallelConfig(tp=2, sp=sp), config, torch.device("cpu"),
                                                       seq_len=LAYER_SEQ) for sp in (False, True)}
    cp_context = build_parallel_context(ParallelConfig(cp=2), config, torch.device("cpu"), seq_len=LAYER_SEQ)
    for name in RECIPES[1:]:
        single = QuantizedLinear(FEATURES, FEATURES, bias=False)
        single.load_state_dict(full_linear().state_dict())
        reference_recipe = Recipe(name, seed=3)
        results = {}
        for case in ("column", "row", "plain"):
            single_layer = QuantizedLinear(FEATURES, FEATURES, bias=False)
            single_layer.load_state_dict(full_linear().state_dict())
            quantize_layer(single_layer, reference_recipe, case)
            results[case] = run_layer(single_layer, reference_recipe, lambda t: t, lambda t: t)
        for layout, context in contexts.items():
            got = tensor_parallel_layers(context, name)
            for case in ("column", "row"):
                for step, (mine, wanted) in enumerate(zip(got[case], expected_pieces(results[case], case, context))):
                    for quantity, actual, expected in zip(("output", "input grad", "weight grad"), mine, wanted):
                        errors[f"{name} {layout} {case} step {step} {quantity}"] = relative_error(actual, expected)
        positions = context_parallel_positions(cp_context)
        layer = QuantizedLinear(FEATURES, FEATURES, bias=False)
        layer.load_state_dict(full_linear().state_dict())
        recipe = Recipe(name, seed=3)
        quantize_layer(layer, recipe, "plain", cp_context, reduce_max)
        got = run_layer(layer, recipe, lambda t: t[:, positions], lambda t: t[:, positions], (cp_context.cp_group,))
        for step, ((out, dx, dw), (ref_out, ref_dx, ref_dw)) in enumerate(zip(got, results["plain"])):
            all_reduce_(dw, cp_context.cp_group)  # each rank's tokens' share of the weight gradient
            errors[f"{name} cp2 step {step} output"] = relative_error(out, ref_out[:, positions])
            errors[f"{name} cp2 step {step} input grad"] = relative_error(dx, ref_dx[:, positions])
            errors[f"{name} cp2 step {step} weight grad"] = relative_error(dw, ref_dw)
    dist.barrier()
    return errors


def test_sharded_layers_quantize_like_one_process():
    every_rank = run_distributed(run_layer_cases, 2, timeout_s=300)
    for rank, errors in enumerate(every_rank):
        assert len(errors) == (len(RECIPES) - 1) * 2 * 3 * (2 * 2 + 1)
        bad = {case: error for case, error in errors.items() if not error <= LAYER_TOLERANCE}
        assert not bad, f"rank {rank}: {bad}"


# --- models -----------------------------------------------------------------------------------------

HARDWARE = ("fp8_tensorwise@hardware", "fp8_delayed@hardware") if hardware_fp8_supported(
    "cpu", "tensorwise", out_dtype=torch.float32) else ()
"""The per-tensor recipes on the FP8 GEMM (torch._scaled_mm, which this CPU runs): q, k and v then
share one cast of their input (``quantized_projections.py``), in one process and at tp 2 alike."""
MODELS = {
    "dense": (dict(vocab_size=VOCAB, hidden_size=256, pattern="*-*-", num_attention_heads=8, num_kv_heads=8,
                   ffn_hidden_size=512), ("fp8_tensorwise", "fp8_delayed", "fp8_blockwise", "mxfp8", *HARDWARE)),
    "hybrid": (dict(vocab_size=VOCAB, hidden_size=64, pattern="M-*-", num_attention_heads=4, num_kv_heads=2,
                    ffn_hidden_size=128, mamba_head_dim=16, mamba_state_size=16, mamba_num_groups=2),
               ("fp8_tensorwise", "fp8_delayed")),
}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.detach() - expected.detach()).abs().max() / expected.detach().abs().max())


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, BATCH, SEQ + 1), generator=generator)
    return [(step[:, :-1], step[:, 1:]) for step in tokens]


def two_steps(model, recipe: Recipe, context=None) -> list[dict]:
    """Loss and full gradients of two forward/backward steps (no update: the same weights)."""
    results = []
    for step, (input_ids, labels) in enumerate(batches()):
        recipe.step = step
        begin_step(model)
        loss = model(input_ids, labels, return_logits=False).loss
        loss.backward()
        finish_step(model, (context.tp_group,) if context is not None else (), reduce_max)
        grads = {}
        if context is not None:
            reduce_partial_tp_grads(model, context)
        for name, param in model.named_parameters():
            grads[name] = gather_full_tensor(param, param.grad, context) if context is not None else param.grad.clone()
        model.zero_grad(set_to_none=True)
        results.append({"loss": loss.detach(), "grads": grads})
    return results


def run_all_cases() -> dict:
    errors = {}
    for model_name, (overrides, recipes) in MODELS.items():
        torch.manual_seed(0)
        full = LanguageModel(ModelConfig(**overrides))
        for name in recipes:
            reference_model = copy.deepcopy(full)
            apply_recipe(reference_model, make_recipe(name), full.config.num_blocks)
            hardware = {module.quantization.hardware for module in reference_model.modules()
                        if getattr(module, "quantization", None) is not None}
            assert hardware == {name.endswith("@hardware")}, (name, hardware)
            reference = two_steps(reference_model, reference_model_recipe(reference_model))
            for sp in (False, True):
                context = build_parallel_context(ParallelConfig(tp=2, sp=sp), full.config, torch.device("cpu"),
                                                 seq_len=SEQ)
                model = parallelize_model(copy.deepcopy(full), context)
                recipe = make_recipe(name)
                apply_recipe(model, recipe, full.config.num_blocks, context=context, seq_len=SEQ, reduce_max=reduce_max)
                for step, (got, wanted) in enumerate(zip(two_steps(model, recipe, context), reference)):
                    case = f"{model_name} {name} sp={sp} step {step}"
                    errors[f"{case}: loss"] = relative_error(got["loss"], wanted["loss"]) * GRAD_TOLERANCE / LOSS_TOLERANCE
                    for param, grad in wanted["grads"].items():
                        errors[f"{case}: grad {param}"] = relative_error(got["grads"][param], grad)
    dist.barrier()
    return errors


def make_recipe(spec: str) -> Recipe:
    """``NAME`` or ``NAME@FP8_GEMM`` (e.g. ``fp8_delayed@hardware``), seeded alike in every run."""
    name, _, fp8_gemm = spec.partition("@")
    return Recipe(name, seed=3, fp8_gemm=fp8_gemm or "auto")


def reference_model_recipe(model) -> Recipe:
    """The recipe object ``apply_recipe`` put on a model (each run keeps its own step)."""
    return next(module.quantization.recipe for module in model.modules() if getattr(module, "quantization", None))


def test_tensor_parallel_models_under_recipes_match_single_process():
    """Errors are scaled so that GRAD_TOLERANCE is the bound for all (losses: LOSS_TOLERANCE)."""
    every_rank = run_distributed(run_all_cases, 2, timeout_s=300)
    for rank, errors in enumerate(every_rank):
        assert len(errors) > 2 * 2 * 6 * 10
        bad = {case: error for case, error in errors.items() if not error <= GRAD_TOLERANCE}
        assert not bad, f"rank {rank}: {bad}"


def refuse_misaligned_blocks() -> str:
    config = ModelConfig(**MODELS["hybrid"][0])
    context = build_parallel_context(ParallelConfig(tp=2), config, torch.device("cpu"), seq_len=SEQ)
    model = parallelize_model(LanguageModel(config, seed=0), context)
    try:
        apply_recipe(model, Recipe("nvfp4"), config.num_blocks, context=context, seq_len=SEQ, reduce_max=reduce_max)
    except ConfigError as error:
        return str(error)
    return "not refused"


def test_blocks_straddling_ranks_are_refused():
    message = run_distributed(refuse_misaligned_blocks, 2)[0]
    assert message.startswith("precision.recipe=nvfp4 scales blocks of 16 elements, but this layout cuts block 0 "
                              "mixer.in_proj's output features (per partition, per rank) into shards of "), message
    assert "use a smaller parallel.tp, or use precision.recipe=fp8_tensorwise or fp8_delayed" in message


def test_context_parallel_chunks_must_hold_whole_blocks():
    from types import SimpleNamespace
    from meshlm.precision.model_recipe import check_sequence_cut
    check_sequence_cut(Recipe("nvfp4"), SimpleNamespace(cp_size=2), seq_len=64)  # chunks of 16
    check_sequence_cut(Recipe("fp8_tensorwise"), SimpleNamespace(cp_size=2), seq_len=36)
    with pytest.raises(ConfigError, match=r"cuts every linear layer's tokens .* into shards of \[16\], not multiples "
                                          r"of 32.*use a train.seq_len that is a multiple of 128"):
        check_sequence_cut(Recipe("mxfp8"), SimpleNamespace(cp_size=2), seq_len=64)


def one_step_of_two_micro_batches(model, context, keep: bool) -> dict:
    """Both micro-batches of ``batches()`` as one step (gradients accumulated), inside
    ``keeping_weight_codes`` (as the trainer's step) or not: the losses and the full gradients."""
    begin_step(model)
    with keeping_weight_codes(model) if keep else contextlib.nullcontext():
        losses = []
        for input_ids, labels in batches():
            loss = model(input_ids, labels, return_logits=False).loss
            loss.backward()
            losses.append(loss.detach())
    finish_step(model, (context.tp_group,) if context is not None else (), reduce_max)
    if context is not None:
        reduce_partial_tp_grads(model, context)
    grads = {name: gather_full_tensor(param, param.grad, context) if context is not None else param.grad.clone()
             for name, param in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return {"losses": losses, "grads": grads}


def run_kept_codes_cases() -> dict:
    """fp8_delayed on the FP8 GEMM at tp 2 (sp off and on): a step's micro-batches with each weight
    cast once and kept equal, bit for bit, the same step casting every micro-batch, and match one
    process keeping them as the layouts above match."""
    overrides = MODELS["dense"][0]
    torch.manual_seed(0)
    full = LanguageModel(ModelConfig(**overrides))
    reference_model = copy.deepcopy(full)
    apply_recipe(reference_model, make_recipe("fp8_delayed@hardware"), full.config.num_blocks)
    reference = one_step_of_two_micro_batches(reference_model, None, keep=True)
    errors, mismatches = {}, []
    for sp in (False, True):
        context = build_parallel_context(ParallelConfig(tp=2, sp=sp), full.config, torch.device("cpu"), seq_len=SEQ)
        runs = {}
        for keep in (True, False):
            model = parallelize_model(copy.deepcopy(full), context)
            apply_recipe(model, make_recipe("fp8_delayed@hardware"), full.config.num_blocks, context=context,
                         seq_len=SEQ, reduce_max=reduce_max)
            runs[keep] = one_step_of_two_micro_batches(model, context, keep)
        kept, every = runs[True], runs[False]
        if not (all(torch.equal(a, b) for a, b in zip(kept["losses"], every["losses"]))
                and all(torch.equal(kept["grads"][name], every["grads"][name]) for name in kept["grads"])):
            mismatches.append(f"sp={sp}")
        for index, (got, wanted) in enumerate(zip(kept["losses"], reference["losses"])):
            errors[f"sp={sp} loss {index}"] = relative_error(got, wanted) * GRAD_TOLERANCE / LOSS_TOLERANCE
        for name, grad in reference["grads"].items():
            errors[f"sp={sp} grad {name}"] = relative_error(kept["grads"][name], grad)
    dist.barrier()
    return {"errors": errors, "mismatches": mismatches}


@pytest.mark.skipif(not HARDWARE, reason=f"torch {torch.__version__} runs no tensorwise torch._scaled_mm on this CPU")
def test_weight_codes_kept_over_micro_batches_at_tp2_match():
    for rank, result in enumerate(run_distributed(run_kept_codes_cases, 2, timeout_s=300)):
        assert result["mismatches"] == [], f"rank {rank}: kept codes differ from casting every micro-batch"
        assert len(result["errors"]) > 2 * 10
        bad = {case: error for case, error in result["errors"].items() if not error <= GRAD_TOLERANCE}
        assert not bad, f"rank {rank}: {bad}"
