"""The fused GPU paths against meshlm's PyTorch reference paths, on the GPU.

- **FlashAttention through SDPA.** ``attention_core`` (causal, GQA: 4 query heads over 2 KV
  heads) in bf16 with SDPA forced to its flash backend, against the explicit softmax of
  ``attention_with_dropout`` (no dropout) in fp32 on the same bf16-rounded inputs: output and
  input gradients. bf16 cannot match fp32 exactly, so the bound is relative to what bf16 costs
  anyway: the flash error at most twice that of SDPA's math backend in bf16, plus 2e-3 of the
  largest value.
- **Each preferred SDPA kernel** (``model.attention_kernel``: flash, cudnn, efficient, and auto,
  which is cuDNN first on Hopper; set process-wide as the trainer sets it) against the same
  explicit softmax with the same bound, causal,
  GQA and plain multi-head, head sizes 64 and 128; and which aten kernel actually ran: the one
  preferred for plain multi-head attention on a GPU that has it (cuDNN needs sm80 and cuDNN 9).
  Under cuDNN first, the masked calls too: a left-padded row, and one query over 128 cached keys.
- **Sliding-window attention**: the chunked windowed core (``model.sliding_window``) in bf16
  against the explicit softmax under the band mask in fp32, with the same bound.
- **Value heads narrower than the keys** (multi-head latent attention): DeepSeek-V3's 192/128
  heads in bf16 under each preferred kernel against the explicit softmax in fp32, and the latent
  cache's decoding call (one key/value head for 16 query heads).
- **Soft-capped attention**: the explicit capped core (``model.attention_softcap``, its own
  chunked backward), causal and windowed, in bf16 against the explicit capped softmax in fp32,
  with the same bound against that softmax in bf16.
- **Attention sinks on the fused kernels** (``meshlm/models/sink_attention.py``): whole sequences
  and sliding windows in bf16 against the explicit sink softmax in fp32, the sinks' gradient too.
- **Ring attention's fused blocks** (``meshlm/models/block_attention.py``): on CUDA a
  block goes to FlashAttention-2's aten ops (bf16) or the memory-efficient ones (fp32), called
  by schema and never run on a GPU before this tier. Output, lse and the block backward against
  the explicit-matmul reference in fp64, causal and not, GQA.
- **Grouped GEMM for the experts** (``meshlm/models/moe/experts.py``): ``F.grouped_mm`` against
  the per-expert loop, bf16, with an expert that gets no tokens; values and gradients, against
  the loop in fp32 (same 2x-plus-slack bound). On CUDA the experts must pick the grouped kernel.
- **Triton SSD kernels** (``meshlm/kernels/ssd_diagonal.py``): the chunked scan with the kernels
  (``use_triton=True``) against the PyTorch scan and the fp32 einsum reference, in fp32 (1e-4)
  and bf16 (the 2x-plus-slack bound against the fp32 reference); values and all gradients.
- **TF32**: a trainer on CUDA turns TF32 on (``precision.tf32`` default), in fp32 and in bf16
  (whose SSD state products and router stay fp32), off when told; ``precision.dtype=auto`` is bf16
  on CUDA.
- **Mamba in bf16**: a hybrid model's loss, logits and gradients in bf16 with each SSD scan (auto
  -- the Triton kernels on CUDA --, pytorch, reference) are finite and close to the fp32 model's:
  loss within 5e-3 relative, logits within 5e-2 and every gradient within 0.1 of their largest
  element (on the CPU, bf16 lands at 1e-5, 1.1e-2 and 3.1e-2: a wrong scan gradient is off by
  the whole gradient).

Tests whose subject exists only on CUDA (flash kernels, compiled Triton, TF32) skip in a CPU dry
run; the others run there too, against the CPU kernels.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench.attention_kernels import KernelNames
from meshlm.models.attention import attention_core, attention_with_dropout
from meshlm.models.attention_kernels import prefer_attention_kernel
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel
from meshlm.models.moe.experts import GroupedExperts, grouped_linear, grouped_mm_supported
from meshlm.models.ssd import ssd_chunked_scan
from meshlm.models.ssd_fast import ssd_chunked_scan_fast
from meshlm.models.block_attention import (CUDA_EFFICIENT, CUDA_FLASH, block_backward, block_forward,
                                                     fused_kernel, reference_block_backward,
                                                     reference_block_forward)
from meshlm.training.trainer import Trainer
from tests.gpu.devices import require_cuda
from tests.gpu.support import HELPERS, HYBRID, on_device
from tests.helpers.counting_corpus import write_corpus

BF16_SLACK = 2e-3
"""bf16 paths: error vs fp32 at most 2x the plain bf16 path's error, plus this times the largest
expected |value| (at least 1): about one bf16 rounding (2^-9) of it."""


def max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.detach().double() - expected.detach().double()).abs().max())


def seeded(*shape, device, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)


def values_and_grads(function, inputs: list[torch.Tensor], grad_out: torch.Tensor) -> list[torch.Tensor]:
    """[output, d input for each input] of ``function(*inputs)`` given the output's gradient."""
    leaves = [tensor.detach().clone().requires_grad_() for tensor in inputs]
    out = function(*leaves)
    out.backward(grad_out.to(out.dtype))
    return [out.detach(), *(leaf.grad for leaf in leaves)]


# --- attention -----------------------------------------------------------------------------------------

def test_flash_sdpa_matches_the_explicit_softmax(gpu_device):
    require_cuda(gpu_device, "SDPA's CUDA flash backend")
    inputs = [seeded(2, 4, 64, 16, device=gpu_device, seed=0, dtype=torch.bfloat16),
              *(seeded(2, 2, 64, 16, device=gpu_device, seed=seed, dtype=torch.bfloat16) for seed in (1, 2))]
    grad_out = seeded(2, 4, 64, 16, device=gpu_device, seed=3)
    keep = torch.ones(2, 4, 64, 64, dtype=torch.bool, device=gpu_device)
    reference = values_and_grads(lambda q, k, v: attention_with_dropout(q, k, v, None, keep, 0.0),
                                 [tensor.float() for tensor in inputs], grad_out)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # raises if flash cannot take these inputs
        flash = values_and_grads(attention_core, inputs, grad_out)
    with sdpa_kernel(SDPBackend.MATH):
        math = values_and_grads(attention_core, inputs, grad_out)
    for name, got, plain, expected in zip(("out", "dq", "dk", "dv"), flash, math, reference):
        assert got.dtype == torch.bfloat16 and torch.isfinite(got).all(), name
        slack = BF16_SLACK * max(1.0, float(expected.abs().max()))
        assert max_error(got, expected) <= 2 * max_error(plain, expected) + slack, \
            (name, max_error(got, expected), max_error(plain, expected), float(expected.abs().max()))


def test_sliding_window_attention_matches_the_explicit_softmax(gpu_device):
    """The chunked windowed core (a band-masked SDPA call over chunk pairs: the memory-efficient
    kernel takes the mask on CUDA) in bf16 against the explicit softmax under the band mask in
    fp32, with the flash test's bound against SDPA's math backend; and the window's effect: the
    positions past it differ from full causal attention."""
    seq, window = 96, 20
    inputs = [seeded(2, 4, seq, 16, device=gpu_device, seed=0, dtype=torch.bfloat16),
              *(seeded(2, 2, seq, 16, device=gpu_device, seed=seed, dtype=torch.bfloat16) for seed in (1, 2))]
    grad_out = seeded(2, 4, seq, 16, device=gpu_device, seed=3)
    keep = torch.ones(2, 4, seq, seq, dtype=torch.bool, device=gpu_device)
    reference = values_and_grads(lambda q, k, v: attention_with_dropout(q, k, v, None, keep, 0.0, window=window),
                                 [tensor.float() for tensor in inputs], grad_out)
    windowed = values_and_grads(lambda q, k, v: attention_core(q, k, v, window=window), inputs, grad_out)
    with sdpa_kernel(SDPBackend.MATH):
        math = values_and_grads(lambda q, k, v: attention_core(q, k, v, window=window), inputs, grad_out)
    for name, got, plain, expected in zip(("out", "dq", "dk", "dv"), windowed, math, reference):
        assert got.dtype == torch.bfloat16 and torch.isfinite(got).all(), name
        slack = BF16_SLACK * max(1.0, float(expected.abs().max()))
        assert max_error(got, expected) <= 2 * max_error(plain, expected) + slack, \
            (name, max_error(got, expected), max_error(plain, expected), float(expected.abs().max()))
    full = attention_core(*inputs)
    assert max_error(full[:, :, window:], windowed[0][:, :, window:]) > 1e-2


def test_soft_capped_attention_matches_the_explicit_capped_softmax(gpu_device):
    """The soft-capped core (``model.attention_softcap``, meshlm/models/softcap.py: chunked explicit
    scores, its own backward) in bf16, causal and with a window, against the explicit capped softmax
    of ``attention_with_dropout`` in fp32, with the flash test's bound against that explicit
    softmax in bf16; and the cap's effect: the output differs from uncapped attention."""
    seq, cap = 96, 1.0
    inputs = [seeded(2, 4, seq, 16, device=gpu_device, seed=0, dtype=torch.bfloat16),
              *(seeded(2, 2, seq, 16, device=gpu_device, seed=seed, dtype=torch.bfloat16) for seed in (1, 2))]
    grad_out = seeded(2, 4, seq, 16, device=gpu_device, seed=3)
    keep = torch.ones(2, 4, seq, seq, dtype=torch.bool, device=gpu_device)
    for window in (None, 20):
        explicit = lambda q, k, v: attention_with_dropout(q, k, v, None, keep, 0.0, window=window,  # noqa: E731
                                                          softcap=cap)
        reference = values_and_grads(explicit, [tensor.float() for tensor in inputs], grad_out)
        capped = values_and_grads(lambda q, k, v: attention_core(q, k, v, window=window, softcap=cap), inputs,
                                  grad_out)
        plain = values_and_grads(explicit, inputs, grad_out)
        for name, got, baseline, expected in zip(("out", "dq", "dk", "dv"), capped, plain, reference):
            assert got.dtype == torch.bfloat16 and torch.isfinite(got).all(), (window, name)
            slack = BF16_SLACK * max(1.0, float(expected.abs().max()))
            assert max_error(got, expected) <= 2 * max_error(baseline, expected) + slack, \
                (window, name, max_error(got, expected), max_error(baseline, expected), float(expected.abs().max()))
        assert max_error(attention_core(*inputs, window=window), capped[0]) > 1e-2


@pytest.mark.parametrize("with_sinks, windows", [(True, (None, 20)), (False, (20, 32))],
                         ids=["sinks", "plain-window"])
def test_sinks_and_windows_on_the_fused_kernels_match_the_explicit_softmax(gpu_device, with_sinks, windows):
    """The fused kernels' paths that merge rows by their lse (``meshlm/models/sink_attention.py``:
    FlashAttention-2's aten ops in bf16 on CUDA, called by schema, first run on a GPU on 2026-11-30),
    against the explicit softmax of ``attention_with_dropout`` in fp32 with the flash test's bound
    against that softmax in bf16:

    - attention sinks (``model.attention_sinks``) over whole sequences and a window of 20, the sink
      merged after; the sinks' gradient too, and their effect (the output differs from plain attention);
    - a sliding window without sinks or a cap (Mistral, Gemma 3, Qwen windows): two causal blocks a
      chunk (``fused_windowed_attention``), a window of 20 over 96 tokens (the last chunk padded) and
      one of 32 (chunks that fit); and the window's effect."""
    seq = 96
    inputs = [seeded(2, 4, seq, 16, device=gpu_device, seed=0, dtype=torch.bfloat16),
              *(seeded(2, 2, seq, 16, device=gpu_device, seed=seed, dtype=torch.bfloat16) for seed in (1, 2))]
    if with_sinks:
        inputs.append(seeded(4, device=gpu_device, seed=4, dtype=torch.bfloat16))
    grad_out = seeded(2, 4, seq, 16, device=gpu_device, seed=3)
    keep = torch.ones(2, 4, seq, seq, dtype=torch.bool, device=gpu_device)
    for window in windows:
        explicit = lambda q, k, v, *sinks: attention_with_dropout(  # noqa: E731
            q, k, v, None, keep, 0.0, window=window, sinks=sinks[0] if sinks else None)
        reference = values_and_grads(explicit, [tensor.float() for tensor in inputs], grad_out)
        fused = values_and_grads(lambda q, k, v, *sinks: attention_core(q, k, v, window=window,
                                                                         sinks=sinks[0] if sinks else None),
                                 inputs, grad_out)
        plain = values_and_grads(explicit, inputs, grad_out)
        for name, got, baseline, expected in zip(("out", "dq", "dk", "dv", "dsinks"), fused, plain, reference):
            assert got.dtype == torch.bfloat16 and torch.isfinite(got).all(), (window, name)
            # a sink's gradient sums a term of every row (2 x 96 here) from the bf16 output, as the fused
            # backward's D = rowsum(dO * O) does: a bf16 ulp of the sum (2^-7 relative), not half of one
            units = 4 if name == "dsinks" else 1
            slack = units * BF16_SLACK * max(1.0, float(expected.abs().max()))
            assert max_error(got, expected) <= 2 * max_error(baseline, expected) + slack, \
                (window, name, max_error(got, expected), max_error(baseline, expected), float(expected.abs().max()))
        # the sinks' effect (the same window without them), or the window's (whole attention)
        without = attention_core(*inputs[:3], window=window) if with_sinks else attention_core(*inputs)
        assert max_error(without, fused[0]) > 1e-2


KERNEL_SLACK = 1e-2
"""The slack of the preferred-kernel test, larger than ``BF16_SLACK`` because its shapes are the
real ones (128 tokens, head sizes up to 128): a fused kernel rounds the probabilities to bf16 and
sums 128 of them per gradient element, a few bf16 roundings of the largest value (2^-8 each). On
the CPU's own flash kernel the worst case, dk at head size 128, lands at 0.0225 against 0.0078 for
the math path and a largest value of 3.1: over ``BF16_SLACK``'s bound (0.022), inside this one
(0.046). A wrong kernel is off by the size of the values themselves."""

KERNEL_OPS = {"flash": "_scaled_dot_product_flash_attention", "cudnn": "_scaled_dot_product_cudnn_attention",
              "efficient": "_scaled_dot_product_efficient_attention"}
"""The aten operator each preferred kernel runs as on CUDA."""


@pytest.mark.parametrize("kernel", ["efficient", "cudnn", "auto"])
def test_value_heads_narrower_than_the_keys_match_the_explicit_softmax(gpu_device, kernel):
    """Multi-head latent attention's core (``model.attention_type=mla``): query/key heads of 192,
    value heads of 128 (DeepSeek-V3's), in bf16 under each preferred kernel (the values zero-padded
    to 192 in ``scaled_dot_product``, so flash takes them too), against the explicit softmax in fp32 with the
    preferred-kernel test's bound; and its decoding call (one cached key/value head of latents for every query head,
    the heads folded into rows), against the explicit softmax of the repeated head."""
    seq, heads = 64, 4
    inputs = [seeded(2, heads, seq, 192, device=gpu_device, seed=0, dtype=torch.bfloat16),
              seeded(2, heads, seq, 192, device=gpu_device, seed=1, dtype=torch.bfloat16),
              seeded(2, heads, seq, 128, device=gpu_device, seed=2, dtype=torch.bfloat16)]
    grad_out = seeded(2, heads, seq, 128, device=gpu_device, seed=3)
    keep = torch.ones(2, heads, seq, seq, dtype=torch.bool, device=gpu_device)
    reference = values_and_grads(lambda q, k, v: attention_with_dropout(q, k, v, None, keep, 0.0),
                                 [tensor.float() for tensor in inputs], grad_out)
    plain = values_and_grads(lambda q, k, v: attention_with_dropout(q, k, v, None, keep, 0.0), inputs, grad_out)
    before = torch._C._get_sdp_priority_order()
    try:
        prefer_attention_kernel(kernel, gpu_device)  # as the trainer does for model.attention_kernel
        got_all = values_and_grads(attention_core, inputs, grad_out)
        query = seeded(2, 16, 1, 576, device=gpu_device, seed=4, dtype=torch.bfloat16)
        latent_keys = seeded(2, 1, seq, 576, device=gpu_device, seed=5, dtype=torch.bfloat16)
        latents, scale = latent_keys[..., :512], 192 ** -0.5
        decoded = attention_core(query, latent_keys, latents, scale=scale)
    finally:
        torch._C._set_sdp_priority_order(before)
    for name, got, baseline, expected in zip(("out", "dq", "dk", "dv"), got_all, plain, reference):
        assert got.dtype == torch.bfloat16 and got.shape == expected.shape and torch.isfinite(got).all(), name
        slack = KERNEL_SLACK * max(1.0, float(expected.abs().max()))
        assert max_error(got, expected) <= 2 * max_error(baseline, expected) + slack, \
            (name, max_error(got, expected), max_error(baseline, expected), float(expected.abs().max()))
    scores = (query.float() @ latent_keys.float().transpose(-1, -2)) * scale
    expected = torch.softmax(scores, dim=-1) @ latents.float()
    assert decoded.shape == (2, 16, 1, 512)
    plain_decoded = torch.softmax((query @ latent_keys.transpose(-1, -2)).float() * scale, dim=-1).to(
        torch.bfloat16) @ latents
    slack = KERNEL_SLACK * max(1.0, float(expected.abs().max()))
    assert max_error(decoded, expected) <= 2 * max_error(plain_decoded, expected) + slack


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
@pytest.mark.parametrize("kernel", ["flash", "cudnn", "efficient", "auto"])
def test_each_preferred_kernel_matches_the_explicit_softmax(gpu_device, kernel, kv_heads, head_dim):
    require_cuda(gpu_device, "SDPA's CUDA kernels")
    query = seeded(2, 4, 128, head_dim, device=gpu_device, seed=10, dtype=torch.bfloat16)
    key, value = (seeded(2, kv_heads, 128, head_dim, device=gpu_device, seed=seed, dtype=torch.bfloat16)
                  for seed in (11, 12))
    grad_out = seeded(2, 4, 128, head_dim, device=gpu_device, seed=13)
    keep = torch.ones(2, 4, 128, 128, dtype=torch.bool, device=gpu_device)
    reference = values_and_grads(lambda q, k, v: attention_with_dropout(q, k, v, None, keep, 0.0),
                                 [tensor.float() for tensor in (query, key, value)], grad_out)
    with sdpa_kernel(SDPBackend.MATH):
        math = values_and_grads(attention_core, [query, key, value], grad_out)
    before = torch._C._get_sdp_priority_order()
    try:
        prefer_attention_kernel(kernel, gpu_device)  # as the trainer does for model.attention_kernel
        with KernelNames() as ops:
            preferred = values_and_grads(attention_core, [query, key, value], grad_out)
    finally:
        torch._C._set_sdp_priority_order(before)
    for name, got, plain, expected in zip(("out", "dq", "dk", "dv"), preferred, math, reference):
        assert got.dtype == torch.bfloat16 and torch.isfinite(got).all(), name
        slack = KERNEL_SLACK * max(1.0, float(expected.abs().max()))
        assert max_error(got, expected) <= 2 * max_error(plain, expected) + slack, \
            (name, max_error(got, expected), max_error(plain, expected), float(expected.abs().max()), ops.names)
    wanted = kernel
    if kernel == "auto":
        wanted = "cudnn" if torch.cuda.get_device_capability(gpu_device)[0] == 9 else None
    cudnn_ready = torch.cuda.get_device_capability(gpu_device)[0] >= 8 and (torch.backends.cudnn.version() or 0) >= 90000
    if wanted is not None and kv_heads == 4 and (wanted != "cudnn" or cudnn_ready):
        assert KERNEL_OPS[wanted] in ops.names, (kernel, sorted(ops.names))


@pytest.mark.parametrize("call", ["padded", "decoding"])
@pytest.mark.parametrize("kernel", ["cudnn", "auto"])
def test_preferred_kernels_keep_masked_and_decoding_calls_right(gpu_device, kernel, call):
    """The calls with a mask (a left-padded row) or one query over a cache (generation, which RL
    runs inside the trainer's process, under the trainer's order) against the explicit softmax."""
    require_cuda(gpu_device, "SDPA's CUDA kernels")
    queries = 128 if call == "padded" else 1
    query = seeded(2, 4, queries, 128, device=gpu_device, seed=20, dtype=torch.bfloat16)
    key, value = (seeded(2, 2, 128, 128, device=gpu_device, seed=seed, dtype=torch.bfloat16) for seed in (21, 22))
    grad_out = seeded(2, 4, queries, 128, device=gpu_device, seed=23)
    key_mask = torch.ones(2, 128, dtype=torch.bool, device=gpu_device)
    key_mask[1, :40] = False  # the second row is left-padded by 40 tokens
    keep = torch.ones(2, 4, queries, 128, dtype=torch.bool, device=gpu_device)
    reference = values_and_grads(lambda q, k, v: attention_with_dropout(q, k, v, key_mask, keep, 0.0),
                                 [tensor.float() for tensor in (query, key, value)], grad_out)
    with sdpa_kernel(SDPBackend.MATH):
        math = values_and_grads(lambda q, k, v: attention_core(q, k, v, key_mask), [query, key, value], grad_out)
    before = torch._C._get_sdp_priority_order()
    try:
        prefer_attention_kernel(kernel, gpu_device)
        with KernelNames() as ops:
            preferred = values_and_grads(lambda q, k, v: attention_core(q, k, v, key_mask), [query, key, value],
                                         grad_out)
    finally:
        torch._C._set_sdp_priority_order(before)
    for name, got, plain, expected in zip(("out", "dq", "dk", "dv"), preferred, math, reference):
        assert torch.isfinite(got).all(), (name, ops.names)
        slack = KERNEL_SLACK * max(1.0, float(expected.abs().max()))
        assert max_error(got, expected) <= 2 * max_error(plain, expected) + slack, \
            (name, max_error(got, expected), max_error(plain, expected), float(expected.abs().max()), ops.names)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_ring_attention_blocks_use_the_cuda_kernels_like_the_reference(gpu_device, dtype, causal):
    query = seeded(1, 4, 32, 16, device=gpu_device, seed=4, dtype=dtype)
    key, value = (seeded(1, 2, 32, 16, device=gpu_device, seed=seed, dtype=dtype) for seed in (5, 6))
    grad_out = seeded(1, 4, 32, 16, device=gpu_device, seed=7, dtype=dtype)
    if gpu_device.type == "cuda":
        assert fused_kernel(query, key) is (CUDA_FLASH if dtype == torch.bfloat16 else CUDA_EFFICIENT)
    wide = [tensor.double() for tensor in (query, key, value, grad_out)]
    expected_out, expected_lse = reference_block_forward(*wide[:3], causal, scale=0.25)
    expected_grads = reference_block_backward(wide[3], *wide[:3], expected_out, expected_lse, causal, scale=0.25)
    out, lse = block_forward(query, key, value, causal, scale=0.25)
    grads = block_backward(grad_out, query, key, value, out, lse, causal, scale=0.25)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5  # bf16: outputs ~1 rounded to 8 bits; fp32: rounding
    assert max_error(out, expected_out) <= tolerance and max_error(lse, expected_lse) <= tolerance
    for name, got, wanted in zip(("dq", "dk", "dv"), grads, expected_grads):
        assert got.shape == wanted.shape and got.dtype == dtype, name
        assert max_error(got, wanted) <= tolerance * max(1.0, float(wanted.abs().max())), (name, max_error(got, wanted))


# --- grouped GEMM --------------------------------------------------------------------------------------

def test_grouped_gemm_equals_the_per_expert_loop(gpu_device):
    if not hasattr(F, "grouped_mm"):
        pytest.skip(f"torch {torch.__version__} has no F.grouped_mm: the experts run the per-expert loop")
    tokens_per_expert = torch.tensor([40, 0, 24, 64], device=gpu_device)  # expert 1 gets no tokens
    tokens = seeded(128, 64, device=gpu_device, seed=8, dtype=torch.bfloat16)
    weight = seeded(4, 96, 64, device=gpu_device, seed=9, dtype=torch.bfloat16) * 0.1
    grad_out = seeded(128, 96, device=gpu_device, seed=10)
    assert grouped_mm_supported(tokens, weight)  # H100 (sm 9.0) in bf16, or the CPU kernel in a dry run
    reference = values_and_grads(lambda x, w: grouped_linear(x, w, tokens_per_expert, False),
                                 [tokens.float(), weight.float()], grad_out)
    grouped = values_and_grads(lambda x, w: grouped_linear(x, w, tokens_per_expert, True), [tokens, weight], grad_out)
    loop = values_and_grads(lambda x, w: grouped_linear(x, w, tokens_per_expert, False), [tokens, weight], grad_out)
    for name, got, plain, expected in zip(("out", "d tokens", "d weight"), grouped, loop, reference):
        assert got.dtype == torch.bfloat16 and torch.isfinite(got).all(), name
        slack = BF16_SLACK * max(1.0, float(expected.abs().max()))
        assert max_error(got, expected) <= 2 * max_error(plain, expected) + slack, \
            (name, max_error(got, expected), max_error(plain, expected))
    assert float(grouped[2][1].abs().max()) == 0.0  # the empty expert's weight gets no gradient


def test_the_experts_pick_the_grouped_kernel_on_cuda(gpu_device):
    require_cuda(gpu_device, "the CUDA grouped GEMM")
    if not hasattr(F, "grouped_mm"):
        pytest.skip(f"torch {torch.__version__} has no F.grouped_mm: the experts run the per-expert loop")
    config = ModelConfig(hidden_size=64, pattern="E", moe_num_experts=4, moe_ffn_hidden_size=96)
    experts = GroupedExperts(config, 64).to(device=gpu_device, dtype=torch.bfloat16)
    tokens = seeded(16, 64, device=gpu_device, seed=11, dtype=torch.bfloat16)
    assert all(grouped_mm_supported(tokens, weight) for weight in experts.parameters()), \
        "bf16 experts on this GPU fall back to the per-expert loop"


# --- Triton SSD ------------------------------------------------------------------------------------------

def ssd_inputs(device, dtype, seed: int = 12) -> list[torch.Tensor]:
    """x [2, 70, 4, 16] (70: a padded last chunk of 32), dt, A, B, C [2, 70, 2, 16] (2 groups)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 70, 4, 16, generator=generator)
    dt = torch.rand(2, 70, 4, generator=generator) * 0.2 + 0.01
    A = -torch.rand(4, generator=generator) * 4 - 0.5
    B, C = (torch.randn(2, 70, 2, 16, generator=generator) for _ in range(2))
    return [x.to(device, dtype), dt.to(device), A.to(device), B.to(device, dtype), C.to(device, dtype)]


@pytest.mark.parametrize("chunk", [32, 64], ids=["fixed_tile", "autotuned_tiles"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_ssd_scan_equals_the_pytorch_scan(gpu_device, dtype, chunk):
    """Chunks of 32 run the kernels' default tile; chunks of 64 take every tile of
    ``ssd_diagonal.TUNED_TILES``, so the autotuned kernels run (and time each choice first)."""
    require_cuda(gpu_device, "compiled Triton")
    pytest.importorskip("triton")
    inputs = ssd_inputs(gpu_device, dtype)
    grad_y = torch.randn(2, 70, 4, 16, generator=torch.Generator().manual_seed(13)).to(gpu_device)

    def scan(function):
        return lambda x, dt, A, B, C: function(x, dt, A, B, C, chunk)[0]

    reference = values_and_grads(scan(ssd_chunked_scan), [tensor.float() for tensor in inputs], grad_y)
    triton = values_and_grads(scan(lambda *args: ssd_chunked_scan_fast(*args, use_triton=True)), inputs, grad_y)
    pytorch = values_and_grads(scan(lambda *args: ssd_chunked_scan_fast(*args, use_triton=False)), inputs, grad_y)
    for name, got, plain, expected in zip(("y", "dx", "d dt", "dA", "dB", "dC"), triton, pytorch, reference):
        assert torch.isfinite(got).all(), name
        scale = max(1.0, float(expected.abs().max()))
        if dtype == torch.float32:
            assert max_error(got, expected) <= 1e-4 * scale, (name, max_error(got, expected))
        else:
            assert max_error(got, expected) <= 2 * max_error(plain, expected) + BF16_SLACK * scale, \
                (name, max_error(got, expected), max_error(plain, expected))



@pytest.mark.parametrize("chunk", [32, 64], ids=["fixed_tile", "autotuned_tiles"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_ssd_scan_compiled_gives_the_eager_scan(gpu_device, exact_fp32_cuda, dtype, chunk):
    """The Triton scan inside an Inductor graph (as ``train.compile`` runs a Mamba-2 block) against
    the same kernels run eagerly, every output and gradient: the decays' gradients dt and A most of
    all, where an H200's compiled and eager bf16 hybrid blocks put dt_bias and A_log 1.9x to 8.4x
    apart (tests/gpu/test_compiled_blocks.py). fp32 without TF32: the two differ in summation order
    only; bf16: compiled no farther from the fp32 reference than twice eager's error and a rounding."""
    require_cuda(gpu_device, "compiled Triton")
    pytest.importorskip("triton")
    inputs = ssd_inputs(gpu_device, dtype)
    grad_y = torch.randn(2, 70, 4, 16, generator=torch.Generator().manual_seed(17)).to(gpu_device)

    def scan(x, dt, A, B, C):
        return ssd_chunked_scan_fast(x, dt, A, B, C, chunk, use_triton=True)[0]

    torch._dynamo.reset()
    reference = values_and_grads(lambda *args: ssd_chunked_scan(*args, chunk)[0], [tensor.float() for tensor in inputs],
                                 grad_y)
    eager = values_and_grads(scan, inputs, grad_y)
    compiled = values_and_grads(torch.compile(scan, fullgraph=True), inputs, grad_y)
    for name, got, plain, expected in zip(("y", "dx", "d dt", "dA", "dB", "dC"), compiled, eager, reference):
        assert torch.isfinite(got).all(), name
        scale = max(1.0, float(expected.abs().max()))
        if dtype == torch.float32:
            assert max_error(got, plain) <= 1e-4 * scale, (name, max_error(got, plain))
        else:
            assert max_error(got, expected) <= 2 * max_error(plain, expected) + BF16_SLACK * scale, \
                (name, max_error(got, expected), max_error(plain, expected))


# --- TF32 and auto precision ----------------------------------------------------------------------------

@pytest.fixture
def restored_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_tf32_is_on_for_cuda_runs_by_default(gpu_device, tmp_path, restored_tf32):
    require_cuda(gpu_device, "TF32")
    blend = write_corpus(tmp_path / "corpus")
    built = []

    def trainer(*overrides: str) -> Trainer:
        built.append(Trainer(HELPERS.run_config(blend, tmp_path / f"run{len(built)}", *overrides)))
        return built[-1]

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    assert trainer(f"train.device={gpu_device}", "precision.dtype=fp32").tf32
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert not trainer(*on_device(gpu_device, "fp32")).tf32  # precision.tf32=false
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    auto = trainer(f"train.device={gpu_device}", "precision.dtype=auto")
    assert auto.config.precision.dtype == "bf16" and auto.tf32
    assert torch.backends.cuda.matmul.allow_tf32  # a bf16 run's fp32 matmuls (SSD states, router) too
    assert not trainer(f"train.device={gpu_device}", "precision.dtype=bf16", "precision.tf32=false").tf32
    assert not torch.backends.cuda.matmul.allow_tf32


# --- Mamba in bf16 ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("scan", ["auto", "pytorch", "reference"])
def test_hybrid_model_in_bf16_is_close_to_fp32(gpu_device, scan):
    fields = {override.removeprefix("model.").split("=")[0]: override.split("=")[1] for override in HYBRID}
    config = ModelConfig(vocab_size=64, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, mamba_scan=scan,
                         pattern=fields.pop("pattern"), **{name: int(value) for name, value in fields.items()})
    torch.manual_seed(0)
    model = LanguageModel(config).to(gpu_device)
    tokens = torch.randint(0, 64, (2, 65), generator=torch.Generator().manual_seed(14)).to(gpu_device)

    def loss_logits_grads(dtype):
        copy = LanguageModel(config).to(device=gpu_device, dtype=dtype)
        copy.load_state_dict(model.state_dict())
        output = copy(tokens[:, :-1], tokens[:, 1:])
        output.loss.backward()
        grads = {name: param.grad.float() for name, param in copy.named_parameters()}
        return output.loss.detach().float(), output.logits.detach().float(), grads

    loss32, logits32, grads32 = loss_logits_grads(torch.float32)
    loss16, logits16, grads16 = loss_logits_grads(torch.bfloat16)
    assert torch.isfinite(logits16).all() and torch.isfinite(loss16)
    assert abs(float(loss16 - loss32)) <= 5e-3 * float(loss32), (float(loss16), float(loss32))
    assert max_error(logits16, logits32) <= 5e-2 * float(logits32.abs().max()), max_error(logits16, logits32)
    for name, grad in grads32.items():
        assert torch.isfinite(grads16[name]).all(), name
        error = max_error(grads16[name], grad)
        assert error <= 0.1 * float(grad.abs().max()) + 1e-6, (name, error)
