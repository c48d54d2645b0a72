"""Ring attention (meshlm/parallel/context/ring_attention.py) equals full causal attention, forward and backward.

Spawned gloo ranks hold their chunks of fp64 queries/keys/values (GQA: 4 query heads over 2 KV
heads) of a 16-token sequence; each runs ring attention over its CP group, then backward with
its rows of a random output gradient. Its output and dq/dk/dv must equal the rows, at its
positions, of ``F.scaled_dot_product_attention(is_causal=True)`` on the whole sequence and of
its gradients (fp64, 1e-12). At cp 2 and 4, with the balanced chunk pairing and with the naive
contiguous split, and at cp2 x tp2 (each TP rank rings its own heads; CP groups {0, 2}, {1, 3}
are not consecutive ranks); with soft-capped scores (``softcap``, every block on the reference
path) against capped attention written out, at cp2, cp4 with a window and cp2 x tp2; with attention
sinks (``sinks``, merged after the ring) against the sink softmax written out, their gradient summed
over the CP ranks, at cp2 x tp2, cp4 with a window and cp2 with a cap. One process checks the block
rule and the online-softmax merge.

The blocks go through the fused kernel (meshlm/models/block_attention.py; on CPU the
CPU flash kernel, which takes fp64, so every exactness check here is fp64 at 1e-12): one
process checks that the fused block forward/backward equal the explicit-matmul reference, that
per-block backwards given the FINAL output and lse add up to the full gradient, that a block
differentiated by autograd and ring attention itself save nothing of size [c x c] (only q, k, v,
the output and lse; the old fp32 matmul blocks saved the [c x c] probabilities), and the bf16
run: ring attention in bf16 at cp2 against fp32 attention on the same bf16-rounded inputs --
no worse than single-process bf16 SDPA (within 2x its error, plus 2e-3), and no tensor of
[c x c] elements created by any op of its forward or backward.
"""

import pytest
import torch
import torch.nn.functional as F

from meshlm.config import ParallelConfig
from meshlm.models.config import ModelConfig
from meshlm.models.softcap import soft_cap
from meshlm.parallel.context.chunks import CHUNK_LAYOUTS, local_token_positions
from meshlm.models.block_attention import (CPU_FLASH, block_backward, block_forward, fused_kernel,
                                                     reference_block_backward, reference_block_forward)
from meshlm.parallel.context.ring_attention import attention_blocks, merge_into, ring_attention
from meshlm.parallel.collective_checks import compare_collectives
from meshlm.parallel.mesh import ParallelContext, build_parallel_context
from tests.helpers.distributed import run_distributed
from tests.helpers.saved_tensors import LargestTensor, SavedStorages

BATCH, HEADS, KV_HEADS, SEQ, HEAD_DIM = 2, 4, 2, 16, 8


def band_mask(window: int) -> torch.Tensor:
    """[SEQ, SEQ]: key j visible from query i when 0 <= i - j < window (transformers' sliding window)."""
    distance = torch.arange(SEQ)[:, None] - torch.arange(SEQ)[None, :]
    return (distance >= 0) & (distance < window)


def capped_attention(query, key, value, mask, cap, sinks=None):
    """softmax(cap tanh(q k^T / sqrt(d) / cap), masked) v, written out (GQA by repeating K/V); no cap
    with ``cap`` None; ``sinks`` [heads]: one more softmax column per head, with no value."""
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    scores = query @ key.transpose(-1, -2) * query.shape[-1] ** -0.5
    scores = (scores if cap is None else soft_cap(scores, cap)).masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1) @ value
    sink_column = sinks[:, None, None].expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat((scores, sink_column), dim=-1), dim=-1)[..., :-1] @ value


def full_attention_and_gradients(window: int | None = None, softcap: float | None = None, sinks: bool = False):
    generator = torch.Generator().manual_seed(0)
    shapes = [(BATCH, HEADS, SEQ, HEAD_DIM), (BATCH, KV_HEADS, SEQ, HEAD_DIM), (BATCH, KV_HEADS, SEQ, HEAD_DIM)]
    query, key, value = (torch.randn(shape, generator=generator, dtype=torch.float64, requires_grad=True)
                         for shape in shapes)
    grad_out = torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, generator=generator, dtype=torch.float64)
    sink_logits = torch.randn(HEADS, generator=generator, dtype=torch.float64, requires_grad=True) if sinks else None
    if softcap is not None or sinks:
        mask = band_mask(window or SEQ)
        out = capped_attention(query, key, value, mask, softcap, sink_logits)
    elif window is None:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=band_mask(window), enable_gqa=True)
    out.backward(grad_out)
    return (query, key, value), out.detach(), grad_out, sink_logits


def ring_errors(cp: int, tp: int, layout_name: str, window: int | None = None, softcap: float | None = None,
                sinks: bool = False) -> dict:
    context = build_parallel_context(ParallelConfig(cp=cp, tp=tp, check_collectives=True), ModelConfig(),
                                     torch.device("cpu"))
    (query, key, value), out, grad_out, sink_logits = full_attention_and_gradients(window, softcap, sinks)
    layout = CHUNK_LAYOUTS[layout_name]
    positions = local_token_positions(SEQ, context.cp_rank, cp, layout)
    heads = slice(context.tp_rank * HEADS // tp, (context.tp_rank + 1) * HEADS // tp)
    kv_heads = slice(context.tp_rank * KV_HEADS // tp, (context.tp_rank + 1) * KV_HEADS // tp)
    mine = lambda tensor, rows: tensor.detach()[:, rows][:, :, positions].clone()  # noqa: E731
    local = [mine(query, heads).requires_grad_(), mine(key, kv_heads).requires_grad_(),
             mine(value, kv_heads).requires_grad_()]
    local_sinks = None if sink_logits is None else sink_logits.detach()[heads].clone().requires_grad_()
    local_out = ring_attention(*local, context, layout, window=window, softcap=softcap, sinks=local_sinks)
    local_out.backward(mine(grad_out, heads))
    expected = [mine(out, heads), mine(query.grad, heads), mine(key.grad, kv_heads), mine(value.grad, kv_heads)]
    actual = [local_out, *(tensor.grad for tensor in local)]
    names = ["out", "dq", "dk", "dv"]
    if local_sinks is not None:  # each CP rank's rows give a share of the sinks' gradient
        grad_sinks = local_sinks.grad.clone()
        torch.distributed.all_reduce(grad_sinks, group=context.cp_group.process_group)
        expected.append(sink_logits.grad[heads])
        actual.append(grad_sinks)
        names.append("dsinks")
    compare_collectives(context, "after ring attention")  # the ring's messages match, in order
    return {name: float((a - e).abs().max()) for name, a, e in zip(names, actual, expected)}


@pytest.mark.parametrize("cp, tp, layout", [(2, 1, "paired"), (4, 1, "paired"), (4, 1, "contiguous"),
                                            (2, 2, "paired")])
def test_ring_attention_equals_full_causal_attention(cp, tp, layout):
    for rank, errors in enumerate(run_distributed(ring_errors, cp * tp, cp, tp, layout)):
        assert max(errors.values()) <= 1e-12, (rank, errors)


@pytest.mark.parametrize("cp, window", [(2, 3), (2, 6), (4, 3), (4, 9)])
def test_ring_attention_with_a_sliding_window_equals_banded_attention(cp, window):
    # chunks of 16 / (2 cp) = 4 or 2 tokens: windows inside one chunk (the diagonal blocks banded too),
    # across a few chunks (edge blocks banded, far ones skipped, near ones whole)
    for rank, errors in enumerate(run_distributed(ring_errors, cp, cp, 1, "paired", window)):
        assert max(errors.values()) <= 1e-12, (rank, errors)


@pytest.mark.parametrize("cp, tp, window", [(2, 1, None), (4, 1, 3), (2, 2, 6)])
def test_ring_attention_with_soft_capped_scores_equals_capped_attention(cp, tp, window):
    # a cap of 1 on scores of size ~3 (unit q, k, head dim 8): the tanh bends most of them
    for rank, errors in enumerate(run_distributed(ring_errors, cp * tp, cp, tp, "paired", window, 1.0)):
        assert max(errors.values()) <= 1e-12, (rank, errors)


@pytest.mark.parametrize("cp, tp, window, softcap", [(2, 2, None, None), (4, 1, 3, None), (2, 1, None, 1.0)])
def test_ring_attention_with_sinks_equals_the_sink_softmax(cp, tp, window, softcap):
    for rank, errors in enumerate(run_distributed(ring_errors, cp * tp, cp, tp, "paired", window, softcap, True)):
        assert set(errors) == {"out", "dq", "dk", "dv", "dsinks"}
        assert max(errors.values()) <= 1e-12, (rank, errors)


def test_window_band_sorts_blocks_into_whole_cut_and_skipped():
    from meshlm.parallel.context.ring_attention import SKIP, window_band
    # queries 8..11 against keys 4..7 (4 x 4): distances 1 .. 7
    assert window_band(8, 4, 4, 4, window=8) is None  # every distance < 8
    assert window_band(8, 4, 4, 4, window=1) is SKIP  # every distance >= 1
    band = window_band(8, 4, 4, 4, window=4)  # distance 4 + i - j < 4 <=> j - i > 0
    assert band == 0
    # the diagonal block (same positions) with a window of 2: key j hidden when j - i <= -2
    assert window_band(4, 4, 4, 4, window=2) == -2


# --- one process ------------------------------------------------------------------------------------------

def test_blocks_of_the_paired_layout_are_balanced():
    # cp = 2: rank 0 holds chunks (0, 3), rank 1 (1, 2).
    assert attention_blocks((0, 3), (0, 3)) == [(0, 0, True), (1, 0, False), (1, 1, True)]
    assert attention_blocks((0, 3), (1, 2)) == [(1, 0, False), (1, 1, False)]  # only the back chunk reads
    assert attention_blocks((1, 2), (0, 3)) == [(0, 0, False), (1, 0, False)]  # only the front chunk is read
    assert attention_blocks((2, 3), (0, 1)) == [(0, 0, False), (0, 1, False), (1, 0, False), (1, 1, False)]


def test_merging_two_halves_of_the_keys_equals_softmax_over_all():
    generator = torch.Generator().manual_seed(1)
    query = torch.randn(1, 6, 5, 4, generator=generator, dtype=torch.float64)  # [b, heads, t, d], 2 KV heads
    key, value = (torch.randn(1, 2, 8, 4, generator=generator, dtype=torch.float64) for _ in range(2))
    expected, _ = block_forward(query, key, value, causal=False, scale=0.5)
    out = torch.zeros_like(expected)
    lse = torch.full(expected.shape[:-1], float("-inf"), dtype=torch.float64)
    for keys in (slice(4, 8), slice(0, 4)):  # any order
        block_out, block_lse = block_forward(query, key[:, :, keys], value[:, :, keys], causal=False, scale=0.5)
        merge_into(out, lse, slice(0, 5), block_out, block_lse)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


# --- one block through the fused kernel ------------------------------------------------------------------

def block_inputs(heads: int, kv_heads: int, length: int = 12, head_dim: int = 8, dtype=torch.float64, seed: int = 2):
    """query, key, value, grad_out of one block: [1, heads, length, d] and [1, kv_heads, length, d]."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [(1, heads, length, head_dim), (1, kv_heads, length, head_dim), (1, kv_heads, length, head_dim),
              (1, heads, length, head_dim)]
    return [torch.randn(shape, generator=generator, dtype=dtype) for shape in shapes]


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("causal", [True, False])
def test_fused_block_equals_reference(heads, kv_heads, causal):
    query, key, value, grad_out = block_inputs(heads, kv_heads)
    assert fused_kernel(query, key) is CPU_FLASH  # fp64 on CPU: the fused kernel, not the fallback
    out, lse = block_forward(query, key, value, causal, scale=0.3)
    expected_out, expected_lse = reference_block_forward(query, key, value, causal, scale=0.3)
    torch.testing.assert_close(out, expected_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-12, atol=1e-12)
    grads = block_backward(grad_out, query, key, value, out, lse, causal, scale=0.3)
    expected = reference_block_backward(grad_out, query, key, value, expected_out, expected_lse, causal, scale=0.3)
    for name, actual, wanted in zip(("dq", "dk", "dv"), grads, expected):
        assert actual.shape == wanted.shape, name
        torch.testing.assert_close(actual, wanted, rtol=1e-12, atol=1e-12, msg=name)


def test_a_block_no_kernel_takes_falls_back_to_the_reference_in_fp32():
    # Queries and keys of different dtypes: no fused kernel; the reference runs in fp32.
    query, key, value, grad_out = block_inputs(4, 2, dtype=torch.float32)
    key, value = key.bfloat16(), value.bfloat16()
    assert fused_kernel(query, key) is None
    out, lse = block_forward(query, key, value, True, scale=0.3)
    expected_out, expected_lse = reference_block_forward(query, key.float(), value.float(), True, scale=0.3)
    assert out.dtype == lse.dtype == torch.float32
    torch.testing.assert_close(out, expected_out, rtol=0, atol=0)
    grads = block_backward(grad_out, query, key, value, out, lse, True, scale=0.3)
    expected = reference_block_backward(grad_out, query, key.float(), value.float(), out, lse, True, scale=0.3)
    for actual, wanted in zip(grads, expected):
        torch.testing.assert_close(actual, wanted, rtol=0, atol=0)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2)])
def test_block_backwards_with_the_final_output_and_lse_add_up_to_the_full_gradient(heads, kv_heads):
    # Two chunks of 6 tokens: blocks (0, 0) causal, (1, 0) full, (1, 1) causal, as on one rank at cp=1.
    query, key, value, grad_out = block_inputs(heads, kv_heads)
    leaves = [tensor.clone().requires_grad_() for tensor in (query, key, value)]
    expected = F.scaled_dot_product_attention(*leaves, is_causal=True, scale=0.3, enable_gqa=True)
    expected.backward(grad_out)
    first, second = slice(0, 6), slice(6, 12)
    blocks = [(first, first, True), (second, first, False), (second, second, True)]
    out = torch.zeros_like(query)
    lse = torch.full(query.shape[:-1], float("-inf"), dtype=torch.float64)
    for rows, cols, causal in blocks:
        merge_into(out, lse, rows, *block_forward(query[..., rows, :], key[..., cols, :], value[..., cols, :],
                                                  causal, scale=0.3))
    grads = [torch.zeros_like(tensor) for tensor in (query, key, value)]
    for rows, cols, causal in blocks:
        dq, dk, dv = block_backward(grad_out[..., rows, :], query[..., rows, :], key[..., cols, :],
                                    value[..., cols, :], out[..., rows, :], lse[..., rows], causal, scale=0.3)
        grads[0][..., rows, :] += dq
        grads[1][..., cols, :] += dk
        grads[2][..., cols, :] += dv
    torch.testing.assert_close(out, expected.detach(), rtol=1e-12, atol=1e-12)
    for name, actual, leaf in zip(("dq", "dk", "dv"), grads, leaves):
        torch.testing.assert_close(actual, leaf.grad, rtol=1e-12, atol=1e-12, msg=name)


# --- nothing of size [c x c] -----------------------------------------------------------------------------

CHUNK, SMALL_HEAD_DIM = 64, 8
"""c >> d, so that a [c x c] tensor per head is 8x the size of a chunk's queries [c x d]."""


def saved_for_backward(function, *inputs) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Every tensor autograd saves during ``function(*inputs)``, and its result."""
    with SavedStorages() as saved:
        result = function(*inputs)
    return saved.tensors, result


@pytest.mark.parametrize("causal", [True, False])
def test_a_block_differentiated_by_autograd_saves_nothing_of_size_c_by_c(causal):
    query, key, value, _ = block_inputs(4, 2, length=CHUNK, head_dim=SMALL_HEAD_DIM, dtype=torch.float32)
    for tensor in (query, key, value):
        tensor.requires_grad_()
    saved, _ = saved_for_backward(lambda *qkv: block_forward(*qkv, causal, 0.3), query, key, value)
    assert saved and max(tensor.numel() for tensor in saved) <= query.numel(), [t.shape for t in saved]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ring_attention_saves_only_its_inputs_output_and_lse(dtype):
    # cp = 1 (one process, no ring messages in forward): what the autograd function keeps.
    query, key, value, _ = block_inputs(4, 2, length=2 * CHUNK, head_dim=SMALL_HEAD_DIM, dtype=dtype)
    for tensor in (query, key, value):
        tensor.requires_grad_()
    saved, output = saved_for_backward(lambda *qkv: ring_attention(*qkv, ParallelContext()), query, key, value)
    storages = {tensor.untyped_storage().data_ptr() for tensor in saved}
    inputs_and_output = {tensor.untyped_storage().data_ptr() for tensor in (query, key, value, output)}
    lse = [tensor for tensor in saved if tensor.untyped_storage().data_ptr() not in inputs_and_output]
    # The output is saved as the very tensor returned (bf16 in a bf16 run), plus one fp32 lse per row.
    assert storages >= inputs_and_output and len(lse) == 1, [(t.shape, t.dtype) for t in saved]
    assert lse[0].shape == query.shape[:-1] and lse[0].dtype == torch.float32
    assert max(tensor.numel() for tensor in saved) <= query.numel()


# --- bf16 over a CP group ----------------------------------------------------------------------------------

BF16_SEQ, BF16_TOLERANCE = 4 * CHUNK, 2e-3
"""cp = 2: 4 chunks of 64 tokens. Ring bf16 error <= 2 x (single-process bf16 SDPA error) + this."""


def bf16_ring_errors(cp: int) -> dict:
    context = build_parallel_context(ParallelConfig(cp=cp), ModelConfig(), torch.device("cpu"))
    generator = torch.Generator().manual_seed(3)
    shapes = [(1, HEADS, BF16_SEQ, SMALL_HEAD_DIM), (1, KV_HEADS, BF16_SEQ, SMALL_HEAD_DIM),
              (1, KV_HEADS, BF16_SEQ, SMALL_HEAD_DIM), (1, HEADS, BF16_SEQ, SMALL_HEAD_DIM)]
    query, key, value, grad_out = (torch.randn(shape, generator=generator).bfloat16() for shape in shapes)

    def attention_and_gradients(dtype):  # single process, on the whole sequence
        leaves = [tensor.to(dtype, copy=True).requires_grad_() for tensor in (query, key, value)]
        out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
        out.backward(grad_out.to(dtype))
        return [out.detach(), *(leaf.grad for leaf in leaves)]

    expected, single_bf16 = attention_and_gradients(torch.float32), attention_and_gradients(torch.bfloat16)
    positions = local_token_positions(BF16_SEQ, context.cp_rank, cp)
    local = [tensor[:, :, positions].clone().requires_grad_() for tensor in (query, key, value)]
    with LargestTensor() as largest:
        local_out = ring_attention(*local, context)
        local_out.backward(grad_out[:, :, positions])
    actual = [local_out, *(tensor.grad for tensor in local)]
    names = ("out", "dq", "dk", "dv")
    error = lambda a, e: float((a.detach().float() - e[:, :, positions]).abs().max())  # noqa: E731
    return {"ring": {name: error(a, e) for name, a, e in zip(names, actual, expected)},
            "single_bf16": {name: error(s[:, :, positions], e) for name, s, e in zip(names, single_bf16, expected)},
            "dtypes": [str(tensor.dtype) for tensor in actual],
            "largest_numel": largest.numel, "query_numel": local[0].numel()}


def test_bf16_ring_attention_matches_fp32_attention():
    for rank, result in enumerate(run_distributed(bf16_ring_errors, 2, 2)):
        assert result["dtypes"] == ["torch.bfloat16"] * 4, (rank, result)
        for name, error in result["ring"].items():
            assert error <= 2 * result["single_bf16"][name] + BF16_TOLERANCE, (rank, name, result)
        # No op of forward or backward made a tensor of [c x c] per head (c*c = 8 * c*d here).
        assert result["largest_numel"] <= result["query_numel"], (rank, result)
