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


GRADIENT_SHAPES = {
    "dense": dict(pattern="*-*-", num_kv_heads=2),
    "hybrid": dict(pattern="M*-M", mamba_head_dim=16, mamba_state_size=16, mamba_num_groups=2, mamba_chunk_size=16),
    "moe": dict(pattern="*E*-", moe_num_experts=4, moe_top_k=2, moe_ffn_hidden_size=32),
}
"""The model kinds of ``MODEL_KINDS`` as ModelConfig fields (the hybrid's shapes the Triton SSD
kernels take, so on CUDA its Mamba blocks run them inside the compiled graphs)."""
GRADIENT_TOLERANCE = 0.1
"""The largest |compiled - eager| / |eager| (norms over one parameter's gradient) in bf16: the
two round differently, by about a percent; a gradient lost on the way is off by 1 (the whole of it)."""


def _gradients(model, input_ids) -> dict[str, torch.Tensor]:
    model.zero_grad()
    model(input_ids, input_ids).loss.backward()
    return {name: parameter.grad.float().clone() for name, parameter in model.named_parameters()
            if parameter.grad is not None}


@pytest.mark.parametrize("kind", list(GRADIENT_SHAPES))
def test_compiled_blocks_give_every_parameter_the_eager_gradient(kind, gpu_device):
    """Inductor's blocks against the eager ones, parameter by parameter, after one backward: the
    losses of four steps (the test above) barely move when one path's gradient is lost, as the
    Mamba-2 scan's was under torch.compile on torch 2.11 (meshlm/models/function_outputs.py: its
    output, the same tensor object as one computed just before it, got zero gradient)."""
    from meshlm.models.config import ModelConfig
    from meshlm.models.language_model import LanguageModel
    from meshlm.models.scan_kernels import choose_scan_kernels
    from meshlm.training.compile import compile_blocks

    config = ModelConfig(vocab_size=64, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                         **GRADIENT_SHAPES[kind])
    model = LanguageModel(config, seed=0).to(gpu_device, torch.bfloat16)
    assert choose_scan_kernels(model, gpu_device) is None  # on CUDA the hybrid's kernels pass their check
    input_ids = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0)).to(gpu_device)
    expected = _gradients(model, input_ids)
    torch._dynamo.reset()
    notices = []
    assert compile_blocks(model, gpu_device, notices.append) == len(config.pattern) and notices == []
    actual = _gradients(model, input_ids)
    assert notices == [] and actual.keys() == expected.keys()
    gaps = {name: ((actual[name] - gradient).norm() / gradient.norm()).item()
            for name, gradient in expected.items() if gradient.norm() > 0}
    assert len(gaps) > len(expected) // 2
    worst = sorted(gaps.items(), key=lambda item: item[1])[-3:]
    assert max(gaps.values()) <= GRADIENT_TOLERANCE, (kind, worst)
