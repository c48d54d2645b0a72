"""train.compile (meshlm/training/compile.py): compiled blocks train like eager ones; no compiler -> eager, said once."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel
from meshlm.training.compile import CompiledForward, EagerFallback
from meshlm.training.trainer import Trainer
from tests.helpers.compiled_graphs import (GRADIENT_CHECK_SHAPES, GraphCounter, compiled_gradient_gaps,
                                          gradient_check_model, returned_tensors_aliasing_intermediates)


def test_compiled_blocks_give_the_eager_losses(make_config, tmp_path, capsys):
    """Inductor on CPU: the first step compiles the two block kinds (~30 s on a 2-core machine)."""
    settings = ("train.steps=3", "train.eval_every=0", "train.save_every=0")
    eager = Trainer(make_config(*settings, f"train.run_dir={tmp_path / 'eager'}"))
    compiled = Trainer(make_config(*settings, "train.compile=true", f"train.run_dir={tmp_path / 'compiled'}"))
    eager_losses, compiled_losses = eager.run().losses, compiled.run().losses
    assert "running eagerly" not in capsys.readouterr().err
    blocks = compiled.model.blocks
    assert all(isinstance(block.residual_step, CompiledForward) and block.residual_step.fallback.reason is None
               for block in blocks)
    softmax = compiled.model.loss_chunk_softmax  # the fused loss's softmax part is compiled too
    assert isinstance(softmax, CompiledForward) and softmax.fallback.reason is None and eager.model.loss_chunk_softmax is None
    assert list(compiled.model.state_dict()) == list(eager.model.state_dict())  # checkpoints are unchanged
    assert sorted(compiled_losses) == [1, 2, 3]
    for step in (1, 2, 3):
        assert compiled_losses[step] == pytest.approx(eager_losses[step], rel=1e-4)


INDUCTOR_GRADIENT_KINDS = ("dense", "hybrid")
"""The kinds whose gradient check runs Inductor's CPU code here; the others trace the same graphs
with ``aot_eager`` (a gradient lost inside a compiled block is lost in the graphs Dynamo and
AOTAutograd trace, before any backend sees them) because Inductor's C++ build takes 10-40 s a kind
on a 2-core machine with a cold cache. The GPU tier runs every kind through Inductor
(tests/gpu/test_compiled_blocks.py), and the tests below compile the quantized blocks with it."""


@pytest.mark.parametrize("kind", list(GRADIENT_CHECK_SHAPES))
def test_compiled_blocks_give_every_parameter_the_eager_gradient(kind, monkeypatch):
    """fp32, parameter by parameter after one backward (Inductor: ~15-40 s a kind on 2 cores).
    The losses of the test above barely move when one path's gradient is lost inside a compiled
    block, as the Mamba-2 scan's was on torch 2.11 (meshlm/models/function_outputs.py); each
    parameter's gradient shows it as a gap of 1. The two differ by summation order only (~1e-6).
    The sliding window runs fused, as on a GPU (the CPU runs a window this small band-masked)."""
    from meshlm.models import attention as attention_module

    monkeypatch.setattr(attention_module, "FUSED_WINDOW_MIN_ON_CPU", 1)
    cpu = torch.device("cpu")
    model, input_ids = gradient_check_model(kind, cpu, torch.float32)
    backend = "inductor" if kind in INDUCTOR_GRADIENT_KINDS else "aot_eager"
    gaps, parameters = compiled_gradient_gaps(model, input_ids, cpu, backend)
    assert len(gaps) == parameters  # in fp32 every parameter of these models has a gradient
    worst = sorted(gaps.items(), key=lambda item: item[1])[-3:]
    assert max(gaps.values()) <= 1e-4, (kind, worst)


def test_without_a_cpp_compiler_the_run_goes_on_eagerly(make_config, tmp_path, capsys, monkeypatch):
    from torch._inductor import config as inductor_config
    from torch._inductor.cpp_builder import cpp_compiler_search

    # the config's own patch restores it (a monkeypatch of the config module left cpp.cxx missing
    # for every later test of the process that compiled on CPU)
    cpp_compiler_search.cache_clear()
    try:
        with inductor_config.patch({"cpp.cxx": ("meshlm-no-such-compiler",)}):
            settings = ("train.steps=3", "train.eval_every=0", "train.save_every=0")
            fallback = Trainer(make_config(*settings, "train.compile=true", f"train.run_dir={tmp_path / 'fallback'}"))
            losses = fallback.run().losses
    finally:
        cpp_compiler_search.cache_clear()  # the real compiler is found again by the next test
    notices = [line for line in capsys.readouterr().err.splitlines() if "train.compile" in line]
    assert notices == ["meshlm train: train.compile=true but Inductor needs a C++ compiler for CPU code and none "
                       "was found (install g++, or set CXX); running eagerly."]
    assert not any(isinstance(block.residual_step, CompiledForward) for block in fallback.model.blocks)
    eager = Trainer(make_config(*settings, f"train.run_dir={tmp_path / 'eager'}")).run().losses
    assert losses == eager and torch.isfinite(torch.tensor(list(losses.values()))).all()


def small_model(**fields) -> LanguageModel:
    return LanguageModel(ModelConfig(**{"vocab_size": 64, "hidden_size": 32, "num_attention_heads": 4, **fields}),
                         seed=0)


def loss_and_grads(model: LanguageModel, input_ids: torch.Tensor):
    """The model's output on ``input_ids`` (as its own labels) after backward, and a copy of each gradient."""
    model.zero_grad()
    output = model(input_ids, input_ids)
    output.loss.backward()
    return output, [parameter.grad.clone() for parameter in model.parameters()]


def compile_each_block(model: LanguageModel, backend, fallback: EagerFallback) -> None:
    """What ``compile_blocks`` does, with a chosen backend and a fresh Dynamo cache."""
    torch._dynamo.reset()
    for block in model.blocks:
        block.residual_step = CompiledForward(block.residual_step, fallback, backend=backend)


def test_a_block_that_fails_to_compile_runs_eagerly_with_one_notice():
    def failing_backend(graph_module, example_inputs):
        raise RuntimeError("no kernel for this op\n(details)")

    model = small_model(pattern="*-")
    input_ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    expected = model(input_ids, input_ids).loss
    notices = []
    compile_each_block(model, failing_backend, EagerFallback(notices.append))
    assert torch.equal(model(input_ids, input_ids).loss, expected)
    assert torch.equal(model(input_ids, input_ids).loss, expected)  # later calls go straight to eager
    assert notices == ["meshlm train: train.compile=true but failing_backend failed to compile a block "
                       "(RuntimeError: no kernel for this op); running eagerly."]


def test_a_backward_that_fails_to_compile_runs_eagerly_before_any_backward():
    """The backward is compiled with the forward (not lazily at ``backward()``), so its failure
    also becomes the eager fallback, and the step's loss and gradients are eager's."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def failing_backward(graph_module, example_inputs):
        raise RuntimeError("no kernel for this backward op")

    backend = aot_autograd(fw_compiler=lambda graph_module, inputs: make_boxed_func(graph_module.forward),
                           bw_compiler=failing_backward)
    model = small_model(pattern="*-")
    input_ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    expected, expected_grads = loss_and_grads(model, input_ids)
    notices = []
    compile_each_block(model, backend, EagerFallback(notices.append))
    output, grads = loss_and_grads(model, input_ids)
    assert torch.equal(output.loss, expected.loss)
    assert all(torch.equal(grad, expected_grad) for grad, expected_grad in zip(grads, expected_grads))
    assert len(notices) == 1 and notices[0].startswith("meshlm train: train.compile=true but ")
    assert notices[0].endswith(" failed to compile a block (RuntimeError: no kernel for this backward op); "
                               "running eagerly.")


MOE = dict(pattern="*E*E*E", moe_num_experts=4, moe_top_k=2, moe_ffn_hidden_size=32)
DENSE = dict(hidden_size=64, pattern="*-*-", ffn_hidden_size=128)
HYBRID = dict(pattern="M-M-*-", mamba_head_dim=16, mamba_state_size=16, mamba_num_groups=1, mamba_chunk_size=8)


def compiled_twice_like_eager(model: LanguageModel):
    """Compile every block of ``model`` with a backend that keeps its graphs and run it twice on one
    batch: the loss and every gradient equal the eager run's bit for bit. Returns the backend (its
    graphs), the eager output and the two compiled outputs."""
    input_ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    expected, expected_grads = loss_and_grads(model, input_ids)
    counter = GraphCounter()
    compile_each_block(model, counter, EagerFallback(lambda notice: pytest.fail(notice)))
    outputs = []
    for _ in range(2):
        output, grads = loss_and_grads(model, input_ids)
        assert torch.equal(output.loss, expected.loss)
        assert all(torch.equal(grad, expected_grad) for grad, expected_grad in zip(grads, expected_grads))
        outputs.append(output)
    return counter, expected, outputs


@pytest.mark.parametrize("shape", [MOE, HYBRID, dict(MOE, pattern="*E*E*-", parallel_residual=True)],
                         ids=["moe", "hybrid", "moe parallel residual"])
def test_each_block_kind_compiles_once_wherever_it_sits(shape):
    """In bf16 (the dtype whose grouped GEMM the compiler traces on CPU), one graph per block kind
    and no graph breaks (with ``model.parallel_residual`` too: the feed-forward blocks take their
    partner's input as one more tensor). Before: an MoE block appended to ``context.moe_losses`` inside its graph
    (one compile per MoE block before it), ``torch.bincount``'s data-dependent shape broke the
    graph at dispatch, and the Mamba mixer's gated norm (a Function whose backward runs autograd)
    broke it in the middle."""
    counter, expected, outputs = compiled_twice_like_eager(small_model(**shape).to(torch.bfloat16))
    for output in outputs:
        assert [counts.tolist() for counts in output.tokens_per_expert or []] == \
            [counts.tolist() for counts in expected.tokens_per_expert or []]
    kinds = len(set(shape["pattern"]))
    assert len(counter.graphs) == kinds, [graph.code for graph in counter.graphs]


def test_compiled_attention_blocks_read_the_forwards_rope_table():
    """RoPE's cos/sin table is made once per forward, eagerly, and every compiled attention block
    takes it as an input: no graph computes a cosine or a sine (compiled, Inductor had fused each
    block's own table into the rotation, a cos, a sin and a power per element of every head), and
    the table costs no recompile: one graph for the attention blocks, one for the MLPs."""
    counter, _, _ = compiled_twice_like_eager(small_model(**DENSE, position_embedding="rope").to(torch.bfloat16))
    assert len(counter.graphs) == 2, [graph.code for graph in counter.graphs]
    targets = {str(node.target) for graph in counter.graphs for node in graph.graph.nodes}
    assert not {target for target in targets if "cos" in target or "sin" in target}, targets
    assert any("mul" in target for target in targets)  # the rotation itself is in the graph


@pytest.mark.parametrize("shape,dtype", [(HYBRID, torch.float32), (HYBRID, torch.bfloat16), (DENSE, torch.bfloat16),
                                         (MOE, torch.bfloat16)], ids=["hybrid-fp32", "hybrid-bf16", "dense", "moe"])
def test_autograd_functions_in_compiled_blocks_return_tensors_of_their_own(shape, dtype):
    """The scan, the gated norm, the causal conv, the fused projections, the experts: no Function
    traced into a block's graph returns a tensor that is another of its graph's tensors. On torch
    2.11 (the GPU image's) such an output got zero gradient: every Mamba block trained without
    the scan's (its output was ``empty().copy_(y)``), and the norm's output in fp32 runs (a no-op
    ``.to``); eagerly, and on torch 2.13, the gradients were right, so only this check sees it here."""
    model = small_model(**shape).to(dtype)
    counter = GraphCounter()
    compile_each_block(model, counter, EagerFallback(lambda notice: pytest.fail(notice)))
    loss_and_grads(model, torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0)))
    assert counter.graphs
    assert any("fwd_body" in name for graph in counter.graphs for name, _ in graph.named_modules())  # Functions traced
    assert [found for graph in counter.graphs for found in returned_tensors_aliasing_intermediates(graph)] == []


@pytest.mark.parametrize("recipe,rounding,graphs_expected,fp8_gemm,shape", [
    ("fp8_tensorwise", True, 2, "emulated", DENSE), ("fp8_delayed", True, 2, "emulated", DENSE),
    ("fp8_blockwise", True, 2, "emulated", DENSE), ("mxfp8", True, 2, "auto", DENSE),
    ("nvfp4", False, 2, "auto", DENSE),
    ("nvfp4", True, 4, "auto", DENSE),  # stochastic rounding keys its noise by layer: a graph per quantized block
    ("fp8_tensorwise", True, 2, "hardware", DENSE), ("fp8_delayed", True, 2, "hardware", DENSE),  # torch._scaled_mm
    # the experts' GEMMs: one per expert segment, split at the host-side token counts (a known break)
    pytest.param("fp8_delayed", True, None, "hardware", MOE, id="moe-fp8_delayed-hardware"),
])
def test_quantized_blocks_compile_whole(recipe, rounding, graphs_expected, fp8_gemm, shape):
    """Under a low-precision recipe the blocks' quantized GEMMs (a custom autograd Function with the
    quantizers, NVFP4's Hadamard transform and stochastic-rounding noise, or the hardware FP8 GEMM)
    compile into the block's graph, one per block kind where no per-layer constant enters it:
    before, ``int(tensor)`` in the noise key (made for every recipe), the Hadamard signs'
    ``torch.Generator`` and the FP8 GEMM's support probe (another Generator, run at every GEMM)
    broke it."""
    from meshlm.precision.fp8_gemm import hardware_fp8_supported
    from meshlm.precision.model_recipe import apply_recipe
    from meshlm.precision.recipes import Recipe

    if fp8_gemm == "hardware" and not hardware_fp8_supported("cpu", "tensorwise", out_dtype=torch.bfloat16):
        pytest.skip(f"torch {torch.__version__} runs no tensorwise torch._scaled_mm on this CPU")
    model = small_model(**shape).to(torch.bfloat16)
    recipe_object = Recipe(recipe, stochastic_rounding=rounding, fp8_gemm=fp8_gemm)
    recipe_object.step = 3
    assert apply_recipe(model, recipe_object, num_blocks=4) > 0
    quantizations = [module.quantization for module in model.modules() if getattr(module, "quantization", None)]
    assert {quantization.hardware for quantization in quantizations} == {fp8_gemm == "hardware"}
    if recipe_object.hadamard_for_wgrad:
        recipe_object.hadamard_matrix(torch.device("cpu"))  # as the trainer does
    input_ids = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    expected, expected_grads = loss_and_grads(model, input_ids)
    counter = GraphCounter()
    torch._dynamo.reset()
    counters.clear()
    compile_each_block(model, counter, EagerFallback(lambda notice: pytest.fail(notice)))
    output, grads = loss_and_grads(model, input_ids)
    assert torch.equal(output.loss, expected.loss)
    assert all(torch.equal(grad, expected_grad) for grad, expected_grad in zip(grads, expected_grads))
    if graphs_expected is None:  # MoE: only the token counts' break (not, say, a scale pointer read)
        assert {reason.splitlines()[0] for reason in counters["graph_break"]} == {"Data dependent operator"}, \
            dict(counters["graph_break"])
    else:
        assert len(counter.graphs) == graphs_expected, [graph.code for graph in counter.graphs]


def test_nvfp4_with_stochastic_rounding_runs_eagerly_with_one_notice(make_config, tmp_path, capsys):
    settings = ("train.steps=1", "train.eval_every=0", "train.save_every=0", "precision.dtype=bf16",
                "precision.recipe=nvfp4", "train.compile=true")
    trainer = Trainer(make_config(*settings, f"train.run_dir={tmp_path / 'run'}"))
    assert torch.isfinite(torch.tensor(list(trainer.run().losses.values()))).all()
    notices = [line for line in capsys.readouterr().err.splitlines() if "train.compile" in line]
    assert notices == ["meshlm train: train.compile=true but precision.recipe=nvfp4 rounds gradients with noise keyed "
                       "by layer and step, which torch.compile would recompile every step; running eagerly (set "
                       "precision.nvfp4_stochastic_rounding=false to compile)."]
    assert not any(isinstance(block.residual_step, CompiledForward) for block in trainer.model.blocks)


@pytest.mark.parametrize("recipe", ["fp8_tensorwise", "fp8_delayed"])
def test_weight_codes_kept_over_a_steps_micro_batches_compile_without_breaks(recipe):
    """Inside ``keeping_weight_codes`` (the trainer's step) the first micro-batch's blocks cast and
    keep their weights' FP8 codes and the next ones read them: a graph for each of the two cases
    per block kind, no graph break, and the eager numbers."""
    from meshlm.precision.fp8_gemm import hardware_fp8_supported
    from meshlm.precision.model_recipe import apply_recipe
    from meshlm.precision.quantized_linear import keeping_weight_codes
    from meshlm.precision.recipes import Recipe

    if not hardware_fp8_supported("cpu", "tensorwise", out_dtype=torch.bfloat16):
        pytest.skip(f"torch {torch.__version__} runs no tensorwise torch._scaled_mm on this CPU")
    model = small_model(**DENSE).to(torch.bfloat16)
    apply_recipe(model, Recipe(recipe, fp8_gemm="hardware"), num_blocks=4)
    batches = [torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(seed)) for seed in range(3)]

    def step():
        model.zero_grad()
        with keeping_weight_codes(model):
            losses = [model(input_ids, input_ids).loss for input_ids in batches]
            for loss in losses:
                loss.backward()
        return [loss.detach() for loss in losses], [parameter.grad.clone() for parameter in model.parameters()]

    expected_losses, expected_grads = step()
    counter = GraphCounter()
    counters.clear()
    compile_each_block(model, counter, EagerFallback(lambda notice: pytest.fail(notice)))
    losses, grads = step()
    assert all(torch.equal(a, b) for a, b in zip(losses, expected_losses))
    assert all(torch.equal(a, b) for a, b in zip(grads, expected_grads))
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert len(counter.graphs) == 4, [graph.code for graph in counter.graphs]  # attention, MLP: casting, reading
