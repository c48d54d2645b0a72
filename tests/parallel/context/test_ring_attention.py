"""Ring attention (meshlm/parallel/context/ring_attention.py) equals full causal attention, forward and backward.

Spawned gloo ranks hold their chunks of fp64 queries/keys/values (GQA: 4 query heads over 2 KV
heads) of a 16-token sequence; each runs ring attention over its CP group, then backward with
its rows of a random output gradient. Its output and dq/dk/dv must equal the rows, at its
positions, of ``F.scaled_dot_product_attention(is_causal=True)`` on the whole sequence and of
its gradients (fp64, 1e-12). At cp 2 and 4, with the balanced chunk pairing and with the naive
contiguous split, and at cp2 x tp2 (each TP rank rings its own heads; CP groups {0, 2}, {1, 3}
are not consecutive ranks). One process checks the block rule and the online-softmax merge.
"""

import pytest
import torch
import torch.nn.functional as F

from meshlm.config import ParallelConfig
from meshlm.models.config import ModelConfig
from meshlm.parallel.context.chunks import CHUNK_LAYOUTS, local_token_positions
from meshlm.parallel.context.ring_attention import attention_blocks, block_forward, merge_into, ring_attention
from meshlm.parallel.collective_checks import compare_collectives
from meshlm.parallel.mesh import build_parallel_context
from tests.helpers.distributed import run_distributed

BATCH, HEADS, KV_HEADS, SEQ, HEAD_DIM = 2, 4, 2, 16, 8


def full_attention_and_gradients():
    generator = torch.Generator().manual_seed(0)
    shapes = [(BATCH, HEADS, SEQ, HEAD_DIM), (BATCH, KV_HEADS, SEQ, HEAD_DIM), (BATCH, KV_HEADS, SEQ, HEAD_DIM)]
    query, key, value = (torch.randn(shape, generator=generator, dtype=torch.float64, requires_grad=True)
                         for shape in shapes)
    grad_out = torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, generator=generator, dtype=torch.float64)
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)
    out.backward(grad_out)
    return (query, key, value), out.detach(), grad_out


def ring_errors(cp: int, tp: int, layout_name: str) -> dict:
    context = build_parallel_context(ParallelConfig(cp=cp, tp=tp, check_collectives=True), ModelConfig(),
                                     torch.device("cpu"))
    (query, key, value), out, grad_out = full_attention_and_gradients()
    layout = CHUNK_LAYOUTS[layout_name]
    positions = local_token_positions(SEQ, context.cp_rank, cp, layout)
    heads = slice(context.tp_rank * HEADS // tp, (context.tp_rank + 1) * HEADS // tp)
    kv_heads = slice(context.tp_rank * KV_HEADS // tp, (context.tp_rank + 1) * KV_HEADS // tp)
    mine = lambda tensor, rows: tensor.detach()[:, rows][:, :, positions].clone()  # noqa: E731
    local = [mine(query, heads).requires_grad_(), mine(key, kv_heads).requires_grad_(),
             mine(value, kv_heads).requires_grad_()]
    local_out = ring_attention(*local, context, layout)
    local_out.backward(mine(grad_out, heads))
    expected = [mine(out, heads), mine(query.grad, heads), mine(key.grad, kv_heads), mine(value.grad, kv_heads)]
    actual = [local_out, *(tensor.grad for tensor in local)]
    compare_collectives(context, "after ring attention")  # the ring's messages match, in order
    return {name: float((a - e).abs().max()) for name, a, e in zip(("out", "dq", "dk", "dv"), actual, expected)}


@pytest.mark.parametrize("cp, tp, layout", [(2, 1, "paired"), (4, 1, "paired"), (4, 1, "contiguous"),
                                            (2, 2, "paired")])
def test_ring_attention_equals_full_causal_attention(cp, tp, layout):
    for rank, errors in enumerate(run_distributed(ring_errors, cp * tp, cp, tp, layout)):
        assert max(errors.values()) <= 1e-12, (rank, errors)


# --- one process ------------------------------------------------------------------------------------------

def test_blocks_of_the_paired_layout_are_balanced():
    # cp = 2: rank 0 holds chunks (0, 3), rank 1 (1, 2).
    assert attention_blocks((0, 3), (0, 3)) == [(0, 0, True), (1, 0, False), (1, 1, True)]
    assert attention_blocks((0, 3), (1, 2)) == [(1, 0, False), (1, 1, False)]  # only the back chunk reads
    assert attention_blocks((1, 2), (0, 3)) == [(0, 0, False), (1, 0, False)]  # only the front chunk is read
    assert attention_blocks((2, 3), (0, 1)) == [(0, 0, False), (0, 1, False), (1, 0, False), (1, 1, False)]


def test_merging_two_halves_of_the_keys_equals_softmax_over_all():
    generator = torch.Generator().manual_seed(1)
    query = torch.randn(1, 2, 3, 5, 4, generator=generator, dtype=torch.float64)  # [b, kv, group, t, d]
    key, value = (torch.randn(1, 2, 8, 4, generator=generator, dtype=torch.float64) for _ in range(2))
    expected, _ = block_forward(query, key, value, causal=False, scale=0.5)
    out = torch.zeros_like(expected)
    lse = torch.full(expected.shape[:-1], float("-inf"), dtype=torch.float64)
    for keys in (slice(4, 8), slice(0, 4)):  # any order
        block_out, block_lse = block_forward(query, key[:, :, keys], value[:, :, keys], causal=False, scale=0.5)
        merge_into(out, lse, slice(0, 5), block_out, block_lse)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
