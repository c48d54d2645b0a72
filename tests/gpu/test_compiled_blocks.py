"""``train.compile=true`` on the GPU: every block kind compiles whole -- no graph break, no fall
back to eager -- and the compiled bf16 run follows the eager bf16 run.

Inductor on CUDA writes Triton kernels for the blocks' fused math, and a hybrid model's Mamba
blocks call meshlm's own Triton SSD kernels from inside the compiled graph (``mamba_scan=auto``
on CUDA), so this is where a compile failure would appear that the CPU suite cannot see
(tests/training/test_compile.py checks the graphs themselves on CPU with a counting backend). A
block that failed to compile would send the whole run back to eager with one notice; a graph
break (Dynamo's own counter) would split a block into several graphs and slow every step.

Tolerance: compiled and eager bf16 round differently (fused kernels keep intermediates in fp32),
so their losses are compared as tests/gpu/test_model_kinds.py compares bf16 with fp32
(tests/gpu/support.py): within ``LOSS_TOLERANCE`` per step and ``FIRST_STEP_TOLERANCE`` at the first.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from tests.gpu.support import (FIRST_STEP_TOLERANCE, HELPERS, LOSS_TOLERANCE, MODEL_KINDS, SIZE, losses_in_order,
                               on_device, relative_gaps)
from tests.helpers.compiled_graphs import (GRADIENT_CHECK_SHAPES, bf16_gradient_gaps, compiled_gradient_gaps,
                                          gradient_check_model)
from tests.helpers.counting_corpus import write_corpus

STEPS = 4


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("compile-corpus"))


RUNS = {"dense": MODEL_KINDS["dense"], "hybrid": MODEL_KINDS["hybrid"], "moe": MODEL_KINDS["moe"],
        "hybrid tuned ssd": [*MODEL_KINDS["hybrid"], "model.mamba_chunk_size=64"],
        "dense fp8": [*MODEL_KINDS["dense"], "precision.recipe=fp8_tensorwise"]}
"""The model kinds, the hybrid with chunks of 64 (the SSD kernels then run autotuned,
``ssd_diagonal.TUNED_TILES``, inside the compiled graph), and the dense model under the FP8
recipe (on a Hopper GPU its GEMMs are the hardware's, ``torch._scaled_mm``, inside the compiled
graph; elsewhere emulated)."""


@pytest.mark.parametrize("kind", list(RUNS))
def test_compiled_blocks_train_like_eager_without_graph_breaks(kind, corpus, gpu_device, tmp_path, capsys):
    overrides = [*RUNS[kind], *SIZE, f"train.steps={STEPS}", f"train.eval_every={STEPS}",
                 *on_device(gpu_device, "bf16")]
    eager = HELPERS.train_once(corpus, tmp_path / "eager", overrides)
    torch._dynamo.reset()
    counters.clear()
    compiled = HELPERS.train_once(corpus, tmp_path / "compiled", [*overrides, "train.compile=true"])
    notices = [line for line in capsys.readouterr().err.splitlines() if "train.compile" in line]
    assert notices == [], notices
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] > 0  # something was compiled
    for key in ("losses", "val_losses"):
        expected, actual = losses_in_order(eager, key), losses_in_order(compiled, key)
        assert len(actual) == len(expected) > 0 and all(torch.isfinite(torch.tensor(actual))), (key, actual)
        gaps = relative_gaps(compiled, eager, key)
        assert max(gaps) <= LOSS_TOLERANCE, (kind, key, gaps)
        assert gaps[0] <= FIRST_STEP_TOLERANCE, (kind, key, gaps[0])


GRADIENT_TOLERANCE = 1e-3
"""The largest |compiled - eager| / |eager| (norms over one parameter's gradient) in fp32 without
TF32: the two differ in summation order only (below 1e-4 on the CPU, tests/training/test_compile.py);
a gradient lost on the way is off by 1 (the whole of it)."""

BF16_GRADIENT_TOLERANCE = 0.25
"""The largest |bf16 - fp32| / |fp32| of a parameter's gradient, eager or compiled. bf16 rounding
moves them by about a percent (up to 5% on the CPU for the Mamba blocks' dt_bias and A_log, sums
over every token with much cancelling), and a router's top-k choice may flip for a token near a
tie (the DeepSeek-style model's compiled and eager bf16 router gradients were 13% apart on an
H200); a wrong gradient is off by 1 or more (the hybrid's dt_bias: compiled and eager bf16 8.4x
apart on the same H200, before this test asked which of them is off)."""


@pytest.mark.parametrize("kind", list(GRADIENT_CHECK_SHAPES))
def test_compiled_blocks_give_every_parameter_the_eager_gradient(kind, gpu_device, exact_fp32_cuda):
    """Inductor's blocks against the eager ones, parameter by parameter, after one backward, in fp32:
    the losses of four steps (the test above) barely move when one path's gradient is lost, as the
    Mamba-2 scan's was under torch.compile on torch 2.11 (meshlm/models/function_outputs.py: its
    output, the same tensor object as one computed just before it, got zero gradient)."""
    from meshlm.models.scan_kernels import choose_scan_kernels

    model, input_ids = gradient_check_model(kind, gpu_device, torch.float32)
    assert choose_scan_kernels(model, gpu_device) is None  # on CUDA the hybrid's kernels pass their check
    gaps, parameters = compiled_gradient_gaps(model, input_ids, gpu_device)
    assert len(gaps) == parameters  # in fp32 every parameter of these models has a gradient
    worst = sorted(gaps.items(), key=lambda item: item[1])[-3:]
    assert max(gaps.values()) <= GRADIENT_TOLERANCE, (kind, worst)


@pytest.mark.parametrize("kind", list(GRADIENT_CHECK_SHAPES))
def test_bf16_gradients_eager_and_compiled_stay_near_fp32(kind, gpu_device, exact_fp32_cuda):
    """The run's dtype: eager and compiled bf16 gradients each against the fp32 ones, so that a
    failure names the path that is off (the message gives both paths' three worst parameters)."""
    eager, compiled = bf16_gradient_gaps(kind, gpu_device)
    assert len(eager) > len(compiled) // 2 > 0
    worst = {path: sorted(gaps.items(), key=lambda item: item[1])[-3:]
             for path, gaps in (("eager", eager), ("compiled", compiled))}
    assert max(eager.values()) <= BF16_GRADIENT_TOLERANCE and max(compiled.values()) <= BF16_GRADIENT_TOLERANCE, \
        (kind, worst)
