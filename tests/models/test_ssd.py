"""The chunked SSD scan equals the plain sequential recurrence, for any chunk size."""

import pytest
import torch
import torch.nn.functional as F

from meshlm.models.ssd import segment_sum, ssd_chunked_scan, ssd_recurrent_step

BATCH, HEADS, HEAD_DIM, STATE = 2, 4, 3, 5


def sequential_reference(x, dt, A, B, C, initial_state=None):
    """h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T,  y_t = C_t h_t  -- one loop step per token."""
    batch, seq_len, heads, head_dim = x.shape
    heads_per_group = heads // B.shape[2]
    state = (torch.zeros(batch, heads, head_dim, B.shape[-1]) if initial_state is None
             else initial_state.clone())
    outputs = []
    for t in range(seq_len):
        for h in range(heads):
            g = h // heads_per_group
            decay = torch.exp(dt[:, t, h] * A[h])[:, None, None]
            update = dt[:, t, h, None, None] * x[:, t, h, :, None] * B[:, t, g, None, :]
            state[:, h] = decay * state[:, h] + update
        C_per_head = C[:, t].repeat_interleave(heads_per_group, dim=1)
        outputs.append((state * C_per_head[:, :, None, :]).sum(-1))
    return torch.stack(outputs, dim=1), state


def random_inputs(seq_len, groups, seed=0, with_state=False):
    generator = torch.Generator().manual_seed(seed)
    def randn(*shape):
        return torch.randn(*shape, generator=generator)
    x = randn(BATCH, seq_len, HEADS, HEAD_DIM)
    dt = F.softplus(randn(BATCH, seq_len, HEADS) - 1.0)
    A = -torch.exp(randn(HEADS) * 0.5)
    B = randn(BATCH, seq_len, groups, STATE)
    C = randn(BATCH, seq_len, groups, STATE)
    state = randn(BATCH, HEADS, HEAD_DIM, STATE) if with_state else None
    return x, dt, A, B, C, state


def relative_error(actual, expected):
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def test_segment_sum_is_lower_triangular_sums():
    values = torch.tensor([1.0, 2.0, 3.0, 4.0])
    sums = segment_sum(values)
    assert sums[3, 1].item() == 3.0 + 4.0
    assert sums[2, 2].item() == 0.0
    assert sums[1, 2].item() == float("-inf")
    assert torch.allclose(torch.exp(sums).triu(1), torch.zeros(4, 4))


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 8, 16, 64])
def test_chunked_scan_matches_recurrence(chunk_size, groups, with_state):
    x, dt, A, B, C, state = random_inputs(37, groups, seed=chunk_size + groups, with_state=with_state)
    y_ref, final_ref = sequential_reference(x, dt, A, B, C, state)
    y, final = ssd_chunked_scan(x, dt, A, B, C, chunk_size, initial_state=state)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert final.shape == (BATCH, HEADS, HEAD_DIM, STATE)
    assert relative_error(y, y_ref) <= 1e-5
    assert relative_error(final, final_ref) <= 1e-5


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("with_state", [False, True])
def test_recurrent_steps_match_recurrence(groups, with_state):
    x, dt, A, B, C, state = random_inputs(37, groups, seed=3, with_state=with_state)
    y_ref, final_ref = sequential_reference(x, dt, A, B, C, state)
    if state is None:
        state = torch.zeros(BATCH, HEADS, HEAD_DIM, STATE)
    outputs = []
    for t in range(x.shape[1]):
        y_t, state = ssd_recurrent_step(state, x[:, t], dt[:, t], A, B[:, t], C[:, t])
        outputs.append(y_t)
    assert relative_error(torch.stack(outputs, dim=1), y_ref) <= 1e-5
    assert relative_error(state, final_ref) <= 1e-5


def test_sequence_shorter_than_chunk():
    x, dt, A, B, C, _ = random_inputs(5, 2, seed=7)
    y_ref, final_ref = sequential_reference(x, dt, A, B, C)
    y, final = ssd_chunked_scan(x, dt, A, B, C, chunk_size=64)
    assert y.shape[1] == 5
    assert relative_error(y, y_ref) <= 1e-5
    assert relative_error(final, final_ref) <= 1e-5


@pytest.mark.parametrize("split", [1, 13, 16, 36])
def test_carrying_the_state_across_two_calls_equals_one_call(split):
    x, dt, A, B, C, _ = random_inputs(37, 2, seed=11)
    y_full, final_full = ssd_chunked_scan(x, dt, A, B, C, chunk_size=8)
    y_first, state = ssd_chunked_scan(x[:, :split], dt[:, :split], A, B[:, :split], C[:, :split], 8)
    y_second, final = ssd_chunked_scan(x[:, split:], dt[:, split:], A, B[:, split:], C[:, split:], 8,
                                       initial_state=state)
    assert relative_error(torch.cat((y_first, y_second), dim=1), y_full) <= 1e-5
    assert relative_error(final, final_full) <= 1e-5


def test_scan_is_differentiable():
    x, dt, A, B, C, state = random_inputs(20, 2, seed=5, with_state=True)
    inputs = [tensor.requires_grad_() for tensor in (x, dt, A, B, C, state)]
    y, final = ssd_chunked_scan(*inputs[:5], chunk_size=8, initial_state=inputs[5])
    (y.square().sum() + final.square().sum()).backward()
    for tensor in inputs:
        assert tensor.grad is not None and torch.isfinite(tensor.grad).all() and tensor.grad.abs().sum() > 0
