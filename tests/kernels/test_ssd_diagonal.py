"""The Triton kernels of the SSD diagonal blocks (meshlm/kernels/ssd_diagonal.py) against PyTorch.

On a CUDA GPU the kernels run compiled; elsewhere in Triton's interpreter (tests/conftest.py sets
``TRITON_INTERPRET=1``: numpy, one program at a time). Their results are compared with the same
function written as PyTorch tensor ops and differentiated by autograd. The ``[test]`` extra installs
Triton (3.6, the GPU image's release); skipped where it is not installed. The interpreter needs two
fixes for these kernels (a program id as loop bound under NumPy 2.4, bf16 ``tl.dot``), which
tests/conftest.py applies from tests/helpers/triton_interpreter.py.
"""

import pytest
import torch

pytest.importorskip("triton")
import meshlm.kernels.ssd_diagonal as kernels  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

TOLERANCE = dict(rtol=1e-4, atol=1e-4)
"""fp32 in both, summed in different orders; the interpreter's dot products run in numpy fp32."""


def diagonal_reference(u, C, B, cs):
    """(C B^T o L) u with L = exp(clamp(cs_l - cs_s, -80, 0)) below the diagonal, per head."""
    heads, groups, chunk = u.shape[1], B.shape[1], u.shape[3]
    C_heads, B_heads = (tensor.repeat_interleave(heads // groups, dim=1) for tensor in (C, B))
    scores = C_heads @ B_heads.transpose(-1, -2)
    decay = torch.exp((cs[..., :, None] - cs[..., None, :]).clamp(-80.0, 0.0))
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=u.device).tril()
    return (scores * decay * causal) @ u


def random_inputs(chunk, heads=4, groups=2, head_dim=16, state=16, chunks=2, batch=1, seed=0):
    generator = torch.Generator().manual_seed(seed)
    u = torch.randn(batch, heads, chunks, chunk, head_dim, generator=generator)
    C, B = (torch.randn(batch, groups, chunks, chunk, state, generator=generator) for _ in range(2))
    cs = (-torch.rand(batch, heads, chunks, chunk, generator=generator) * 0.3).cumsum(-1)
    return tuple(tensor.to(DEVICE) for tensor in (u, C, B, cs))


TILINGS = [(16, None), (64, None), (128, 64)]
"""(chunk, tile): the default tile (at most ``BLOCK``), and a 128-token chunk in two tiles of 64 rows,
``TUNED_TILES``' largest, which a CUDA run may pick (there the autotuner chooses; here it is asked for)."""


@pytest.mark.parametrize("chunk,tile", TILINGS)
def test_forward_matches_pytorch(chunk, tile):
    u, C, B, cs = random_inputs(chunk)
    assert kernels.supported(chunk, 16, 16, u.dtype)
    torch.testing.assert_close(kernels.diagonal_forward(u, C, B, cs, tile=tile), diagonal_reference(u, C, B, cs),
                               **TOLERANCE)


@pytest.mark.parametrize("chunk,tile", TILINGS)
def test_forward_adds_the_off_diagonal_blocks_of_the_entering_states(chunk, tile):
    u, C, B, cs = random_inputs(chunk, seed=5)
    heads, groups = u.shape[1], B.shape[1]
    states = torch.randn(*u.shape[:3], u.shape[-1], B.shape[-1], generator=torch.Generator().manual_seed(6)).to(DEVICE)
    C_heads = C.repeat_interleave(heads // groups, dim=1)
    expected = diagonal_reference(u, C, B, cs) + cs.exp()[..., None] * (C_heads @ states.transpose(-1, -2))
    torch.testing.assert_close(kernels.diagonal_forward(u, C, B, cs, states, tile=tile), expected, **TOLERANCE)
    with pytest.raises(ValueError, match=r"start_states must be states \[b, h, c, P, N\] in fp32, bf16 or fp16, "
                                         "contiguous or c consecutive slots"):
        kernels.diagonal_forward(u, C, B, cs, states.transpose(-1, -2), tile=tile)
    slots = torch.randn(*u.shape[:2], u.shape[2] + 1, u.shape[-1], B.shape[-1],
                        generator=torch.Generator().manual_seed(16)).to(DEVICE)  # the recurrence's c + 1 slots
    for first in (0, 1):  # the chunks' slots read in place, before or after an extra one
        states = slots[:, :, first:first + u.shape[2]]
        torch.testing.assert_close(kernels.diagonal_forward(u, C, B, cs, states, tile=tile),
                                   kernels.diagonal_forward(u, C, B, cs, states.contiguous(), tile=tile), rtol=0, atol=0)


@pytest.mark.parametrize("chunk,tile", TILINGS)
def test_backward_adds_the_off_diagonal_parts_of_dC_and_dcs(chunk, tile):
    """Given the entering states, the kernels' dC and d cs are those of the diagonal plus
    off-diagonal output (the states' own gradient is the caller's); du and dB are unchanged."""
    u, C, B, cs = random_inputs(chunk, seed=7)
    heads, groups = u.shape[1], B.shape[1]
    states = torch.randn(*u.shape[:3], u.shape[-1], B.shape[-1], generator=torch.Generator().manual_seed(8)).to(DEVICE)
    dy = torch.randn(u.shape, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    leaves = [tensor.clone().requires_grad_() for tensor in (u, C, B, cs)]
    u_, C_, B_, cs_ = leaves
    off_diagonal = cs_.exp()[..., None] * (C_.repeat_interleave(heads // groups, dim=1) @ states.transpose(-1, -2))
    expected = torch.autograd.grad(((diagonal_reference(*leaves) + off_diagonal) * dy).sum(), leaves)
    actual = kernels.diagonal_backward(u, C, B, cs, dy, states, tile=tile)[:4]
    for name, got, want in zip(("du", "dB", "dC", "dcs"), actual, (expected[0], expected[2], expected[1], expected[3])):
        torch.testing.assert_close(got, want, **TOLERANCE, msg=name)
    with pytest.raises(ValueError, match=r"diagonal_backward takes dy contiguous in u's dtype \(torch.float32\), "
                                         "got torch.bfloat16"):
        kernels.diagonal_backward(u, C, B, cs, dy.bfloat16(), states, tile=tile)


@pytest.mark.parametrize("chunk,tile", TILINGS)
def test_backward_adds_the_chunk_states_backward(chunk, tile):
    """Given each chunk state's gradient dS, the kernels add the backward of st = (w o u)^T B,
    w = exp(cs_end - cs), to du, dB and d cs; d cs lacks only the weight terms' sum at each chunk's
    last position, which the caller adds from the returned terms."""
    u, C, B, cs = random_inputs(chunk, seed=10)
    heads, groups = u.shape[1], B.shape[1]
    generator = torch.Generator().manual_seed(11)
    states = torch.randn(*u.shape[:3], u.shape[-1], B.shape[-1], generator=generator).to(DEVICE)
    state_grads = torch.randn(states.shape, generator=generator).to(DEVICE)
    dy = torch.randn(u.shape, generator=generator).to(DEVICE)
    leaves = [tensor.clone().requires_grad_() for tensor in (u, C, B, cs)]
    u_, C_, B_, cs_ = leaves
    B_heads, C_heads = (tensor.repeat_interleave(heads // groups, dim=1) for tensor in (B_, C_))
    output = diagonal_reference(*leaves) + cs_.exp()[..., None] * (C_heads @ states.transpose(-1, -2))
    weighted_u = u_ * torch.exp(cs_[..., -1:] - cs_)[..., None]
    chunk_states = weighted_u.transpose(-1, -2) @ B_heads  # [b, h, c, P, N]
    expected = torch.autograd.grad((output * dy).sum() + (chunk_states * state_grads).sum(), leaves)
    grad_u, grad_B, grad_C, grad_cs, weight_terms, no_dt = kernels.diagonal_backward(
        u, C, B, cs, dy, states, state_grads, tile=tile)
    assert no_dt is None
    # the recurrence's slots read in place: the entering states before the final one, the chunk
    # states' gradients after the initial state's (ssd_fast)
    entering, total = (torch.cat([tensor, tensor[:, :, :1]], dim=2) for tensor in (states, state_grads))
    in_place = kernels.diagonal_backward(u, C, B, cs, dy, entering[:, :, :-1],
                                         torch.cat([total[:, :, -1:], state_grads], dim=2)[:, :, 1:], tile=tile)
    for got, want in zip(in_place[:5], (grad_u, grad_B, grad_C, grad_cs, weight_terms)):
        assert torch.equal(got, want)
    grad_cs[..., -1] += weight_terms.sum(-1)
    for name, got, want in zip(("du", "dB", "dC", "dcs"), (grad_u, grad_B, grad_C, grad_cs),
                               (expected[0], expected[2], expected[1], expected[3])):
        torch.testing.assert_close(got, want, **TOLERANCE, msg=name)


def recurrence(own_states, log_decays, initial):
    """H_0 = initial, H_{c+1} = exp(L_c) H_c + st_c: [b, h, c + 1, P, N]."""
    slots = [initial]
    for chunk in range(own_states.shape[2]):
        slots.append(log_decays[:, :, chunk, None, None].exp() * slots[-1] + own_states[:, :, chunk])
    return torch.stack(slots, dim=2)


STATE_SHAPES = [(16, 16), (64, 16), (16, 128)]
"""(chunk, state): the state in one column tile, or (128) in two of ``STATE_TILE``."""


@pytest.mark.parametrize("chunk,state", STATE_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_initial", [False, True], ids=["zero-start", "initial-state"])
def test_entering_states_are_the_recurrence_of_the_chunk_states(chunk, state, dtype, with_initial):
    """Slot c of the result is the state entering chunk c (slot 0 the initial one), and the final
    state comes apart: the recurrence over the chunks' own states st = (w o u)^T B, w = exp(cs_end - cs),
    with w and w o u rounded to u's dtype as ``ssd_fast._Pieces.chunk_states`` is given them and
    products in fp32. The entering states are stored in u's dtype (the recurrence itself runs in
    fp32: no rounding feeds back), the final state in fp32. In bf16 the roundings may differ: the
    interpreter rounds fp32 to bf16 toward zero (a GPU and PyTorch to nearest), and a GPU's exp may
    differ from PyTorch's in the last bit, which can move a rounded w by one bf16 step; so bf16 is
    held to ``BF16_RELATIVE_ERROR``."""
    u, C, B, cs = random_inputs(chunk, state=state, seed=12, chunks=3)
    u, B = u.to(dtype), B.to(dtype)
    heads, groups = u.shape[1], B.shape[1]
    generator = torch.Generator().manual_seed(17)
    initial = torch.randn(*u.shape[:2], u.shape[-1], B.shape[-1], generator=generator).to(DEVICE)
    weighted = u * torch.exp(cs[..., -1:] - cs)[..., None].to(dtype)
    own = weighted.float().transpose(-1, -2) @ B.float().repeat_interleave(heads // groups, dim=1)
    expected = recurrence(own, cs[..., -1], initial if with_initial else torch.zeros_like(initial))
    entering, final = kernels.entering_states(u, B, cs, initial if with_initial else None)
    assert entering.dtype == dtype and final.dtype == torch.float32
    assert entering.shape == expected[:, :, :-1].shape and final.shape == expected[:, :, -1].shape
    if dtype == torch.float32:
        torch.testing.assert_close(entering, expected[:, :, :-1], **TOLERANCE)
        torch.testing.assert_close(final, expected[:, :, -1], **TOLERANCE)
    else:
        for name, got, want in (("entering", entering, expected[:, :, :-1]), ("final", final, expected[:, :, -1])):
            assert relative_error(got, want) <= BF16_RELATIVE_ERROR, (name, relative_error(got, want))


@pytest.mark.parametrize("chunk,state", STATE_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_final", [False, True], ids=["no-final-gradient", "final-gradient"])
def test_entering_states_backward_is_autograds(chunk, state, dtype, with_final):
    """Through the recurrence H_{c+1} = exp(L_c) H_c + st_c and the off-diagonal blocks
    y = exp(cs) o (C H_c^T) (what reaches the entering states), the gradients autograd gives each
    chunk's own state st_c, each total log-decay L_c and the initial state. dy, C and the entering
    states come in the run's dtype, as ``entering_states`` stores them, and so do the chunk states'
    gradients (d L and d initial in fp32): in bf16 (e o dy rounded to it, as the forward rounds
    w o u) within bf16 rounding of the fp32 gradients of the same bf16 values; in fp32 the entering
    states are read in place from the recurrence's c + 1 slots."""
    u, C, B, cs = random_inputs(chunk, state=state, seed=13, chunks=3)
    heads, groups = u.shape[1], B.shape[1]
    generator = torch.Generator().manual_seed(14)
    states_shape = (*u.shape[:3], u.shape[-1], B.shape[-1])
    own = torch.randn(states_shape, generator=generator).to(DEVICE).requires_grad_()
    initial = torch.randn(*u.shape[:2], *states_shape[3:], generator=generator).to(DEVICE).requires_grad_()
    log_decays = cs[..., -1].clone().requires_grad_()
    dy = torch.randn(u.shape, generator=generator).to(DEVICE, dtype)
    C = C.to(dtype)
    final_grad = torch.randn(initial.shape, generator=generator).to(DEVICE) if with_final else None
    slots = recurrence(own, log_decays, initial)
    C_heads = C.float().repeat_interleave(heads // groups, dim=1)
    off_diagonal = cs.exp()[..., None] * (C_heads @ slots[:, :, :-1].transpose(-1, -2))
    loss = (off_diagonal * dy.float()).sum() + ((slots[:, :, -1] * final_grad).sum() if with_final else 0)
    expected = torch.autograd.grad(loss, (own, log_decays, initial))
    entering = slots.detach()[:, :, :-1]  # in place in fp32; a bf16 copy as a bf16 run stores it
    actual = kernels.entering_states_backward(dy, C, cs, entering if dtype == torch.float32 else entering.to(dtype),
                                              final_grad)
    for name, got, want, stored in zip(("d st", "d L", "d initial"), actual, expected, (dtype, torch.float32,
                                                                                       torch.float32)):
        assert got.dtype == stored, name
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, **TOLERANCE, msg=name)
        else:
            assert relative_error(got, want) <= BF16_RELATIVE_ERROR, (name, relative_error(got, want))
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    with pytest.raises(ValueError, match=rf"entering_states_backward takes dy contiguous in C's dtype \({dtype}\), "
                                         rf"got {other}"):
        kernels.entering_states_backward(dy.to(other), C, cs, slots.detach()[:, :, :-1])


@pytest.mark.parametrize("chunk,tile", TILINGS)
def test_backward_matches_autograd(chunk, tile):
    u, C, B, cs = random_inputs(chunk, seed=1)
    dy = torch.randn(u.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    leaves = [tensor.clone().requires_grad_() for tensor in (u, C, B, cs)]
    expected_u, expected_C, expected_B, expected_cs = torch.autograd.grad(
        (diagonal_reference(*leaves) * dy).sum(), leaves)
    grad_u, grad_B, grad_C, grad_cs, no_terms, no_dt = kernels.diagonal_backward(u, C, B, cs, dy, tile=tile)
    assert no_terms is None and no_dt is None
    torch.testing.assert_close(grad_u, expected_u, **TOLERANCE)
    torch.testing.assert_close(grad_B, expected_B, **TOLERANCE)
    torch.testing.assert_close(grad_C, expected_C, **TOLERANCE)
    torch.testing.assert_close(grad_cs, expected_cs, **TOLERANCE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunk,tile", [(16, None), (64, 32)])
def test_input_gradients_in_the_kernel_are_du_times_dt_and_the_sum_of_du_x(chunk, tile, dtype):
    """Given dt, the sources kernel writes dx = du dt in x's dtype and natural layout [b, t, h, P],
    and sum_p du x (as (sum_p du u) / dt) in fp32, instead of du: the numbers of du (the kernel's
    other mode) turned into them by PyTorch -- dx bit for bit (one product, one rounding either
    way), the sums to fp32 summation order, and within one rounding of u of the sum over x."""
    batch, heads, chunks, head_dim = 1, 4, 2, 16
    generator = torch.Generator().manual_seed(21)
    x = torch.randn(batch, heads, chunks, chunk, head_dim, generator=generator).to(DEVICE, dtype)
    dt = (torch.rand(batch, heads, chunks, chunk, generator=generator) + 0.05).to(DEVICE)
    u = (x.float() * dt[..., None]).to(dtype)
    _, C, B, cs = random_inputs(chunk, heads=heads, head_dim=head_dim, chunks=chunks, batch=batch, seed=22)
    C, B = C.to(dtype), B.to(dtype)
    dy = torch.randn(u.shape, generator=generator).to(DEVICE, dtype)
    states, state_grads = (torch.randn(*u.shape[:3], head_dim, B.shape[-1], generator=generator).to(DEVICE, dtype)
                           for _ in range(2))
    with_du = kernels.diagonal_backward(u, C, B, cs, dy, states, state_grads, tile=tile)
    with_dx = kernels.diagonal_backward(u, C, B, cs, dy, states, state_grads, tile=tile, dt=dt)
    grad_u, grad_x, grad_dt = with_du[0], with_dx[0], with_dx[5]
    for name, got, want in zip(("dB", "dC", "dcs", "weight terms"), with_dx[1:5], with_du[1:5]):
        assert torch.equal(got, want), name
    assert grad_x.dtype == dtype and grad_x.shape == u.shape and grad_dt.dtype == torch.float32
    natural = grad_x.permute(0, 2, 3, 1, 4).reshape(batch, chunks * chunk, heads, head_dim)  # x's [b, t, h, P]
    assert natural.is_contiguous() and natural.data_ptr() == grad_x.data_ptr()
    assert torch.equal(grad_x, (grad_u * dt[..., None]).to(dtype))
    torch.testing.assert_close(grad_dt, (grad_u * u.float()).sum(-1) / dt, rtol=1e-5, atol=1e-5)
    rounding = 1e-5 if dtype == torch.float32 else 2.0 ** -8  # u = dt x rounded once to x's dtype
    torch.testing.assert_close(grad_dt, (grad_u * x.float()).sum(-1), rtol=rounding, atol=rounding * grad_dt.abs().max())
    with pytest.raises(ValueError, match="diagonal_backward takes dt contiguous in fp32"):
        kernels.diagonal_backward(u, C, B, cs, dy, dt=dt.double())


def test_forward_writes_y_in_the_layout_of_x():
    """y comes back as [b, h, c, Q, P], a view of a contiguous [b, c Q, h, P] tensor -- x's own
    layout, in which the scan returns it -- so no copy turns it back."""
    u, C, B, cs = random_inputs(16, chunks=3, batch=2)
    y = kernels.diagonal_forward(u, C, B, cs)
    natural = y.permute(0, 2, 3, 1, 4).reshape(2, 3 * 16, *y.shape[1:2], y.shape[-1])
    assert natural.is_contiguous() and natural.data_ptr() == y.data_ptr()
    torch.testing.assert_close(y, diagonal_reference(u, C, B, cs), **TOLERANCE)


BF16_RELATIVE_ERROR = 1e-2
"""bf16 u, C, B (a bf16 run): the kernels round the decayed scores to bf16 before their second dot
product and accumulate in fp32, so each result stays within a few bf16 roundings (2^-9) of the fp32
reference on the same bf16 values (measured: 3.2e-3 to 3.7e-3 in norm); a bf16 ``tl.dot`` that
went wrong is off by orders of magnitude."""


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


@pytest.mark.parametrize("chunk", [16, 64])
def test_bf16_operands_stay_within_bf16_rounding_of_the_fp32_reference(chunk):
    """A bf16 run's path: u, C, B, dy, the entering states and their gradients in bf16 (as
    ``entering_states`` and its backward store them); y comes out in bf16, the gradients in fp32."""
    u, C, B, cs = (tensor.bfloat16() if index < 3 else tensor for index, tensor in enumerate(random_inputs(chunk, seed=3)))
    heads, groups = u.shape[1], B.shape[1]
    assert kernels.supported(chunk, 16, 16, u.dtype)
    generator = torch.Generator().manual_seed(4)
    dy = torch.randn(u.shape, generator=generator).to(DEVICE, torch.bfloat16)
    states, state_grads = (torch.randn(*u.shape[:3], u.shape[-1], B.shape[-1], generator=generator)
                           .to(DEVICE, torch.bfloat16) for _ in range(2))
    leaves = [tensor.float().requires_grad_() for tensor in (u, C, B, cs)]
    u_, C_, B_, cs_ = leaves
    C_heads, B_heads = (tensor.repeat_interleave(heads // groups, dim=1) for tensor in (C_, B_))
    expected_y = diagonal_reference(*leaves) + cs_.exp()[..., None] * (C_heads @ states.float().transpose(-1, -2))
    chunk_states = (u_ * torch.exp(cs_[..., -1:] - cs_)[..., None]).transpose(-1, -2) @ B_heads
    expected_u, expected_C, expected_B, expected_cs = torch.autograd.grad(
        (expected_y * dy.float()).sum() + (chunk_states * state_grads.float()).sum(), leaves)
    y = kernels.diagonal_forward(u, C, B, cs, states)
    assert y.dtype == torch.bfloat16
    grad_u, grad_B, grad_C, grad_cs, weight_terms, _ = kernels.diagonal_backward(u, C, B, cs, dy, states, state_grads)
    grad_cs[..., -1] += weight_terms.sum(-1)
    pairs = {"y": (y, expected_y), "du": (grad_u, expected_u), "dB": (grad_B, expected_B),
             "dC": (grad_C, expected_C), "dcs": (grad_cs, expected_cs)}
    for name, (actual, expected) in pairs.items():
        assert name == "y" or actual.dtype == torch.float32, name
        assert relative_error(actual, expected.detach()) <= BF16_RELATIVE_ERROR, (name, relative_error(actual, expected))


def test_every_tuned_tile_divides_the_chunks_that_select_the_tuner():
    assert kernels.BLOCK in kernels.TUNED_TILES
    assert all(max(kernels.TUNED_TILES) % tile == 0 for tile in kernels.TUNED_TILES)
    u, C, B, cs = random_inputs(64)
    with pytest.raises(ValueError, match="a tile of 48 rows does not divide the chunk of 64"):
        kernels.diagonal_forward(u, C, B, cs, tile=48)


def test_small_or_odd_shapes_are_not_supported():
    assert not kernels.supported(16, 8, 16, torch.float32)  # head_dim below tl.dot's 16
    assert not kernels.supported(48, 16, 16, torch.float32)  # chunk not a multiple of the tile
    assert not kernels.supported(64, 16, 24, torch.float32)  # state not a power of two
    assert not kernels.supported(64, 16, 16, torch.float64)


@pytest.mark.parametrize("groups,with_state", [(1, False), (2, True)])
def test_scan_with_kernels_equals_the_pytorch_scan(groups, with_state):
    """``ssd_chunked_scan_fast(use_triton=True)`` (model.mamba_scan=triton): values and all gradients."""
    from meshlm.models.ssd_fast import ssd_chunked_scan_fast
    generator = torch.Generator().manual_seed(groups)
    batch, seq_len, heads, head_dim, state = 2, 70, 4, 16, 16  # 70: a padded last chunk of 32
    x = torch.randn(batch, seq_len, heads, head_dim, generator=generator)
    dt = torch.rand(batch, seq_len, heads, generator=generator) * 0.2 + 0.01
    A = -torch.rand(heads, generator=generator) * 4 - 0.5
    B, C = (torch.randn(batch, seq_len, groups, state, generator=generator) for _ in range(2))
    initial = torch.randn(batch, heads, head_dim, state, generator=generator) if with_state else None
    grad_y = torch.randn(batch, seq_len, heads, head_dim, generator=generator)
    results = []
    for use_triton in (True, False):
        leaves = [tensor.to(DEVICE).requires_grad_() for tensor in (x, dt, A, B, C)]
        start = None if initial is None else initial.to(DEVICE).requires_grad_()
        y, final = ssd_chunked_scan_fast(*leaves, 32, start, use_triton=use_triton)
        targets = leaves + ([start] if start is not None else [])
        grads = torch.autograd.grad((y * grad_y.to(DEVICE)).sum() + final.square().sum(), targets)
        results.append((y, final) + grads)
    for actual, expected in zip(*results):
        torch.testing.assert_close(actual, expected, **TOLERANCE)


def test_tuned_choices_name_each_kernel_and_are_empty_until_the_autotuner_runs():
    choices = kernels.tuned_choices()
    assert set(choices) == {"forward", "backward_sources", "backward_targets"}
    if DEVICE == "cpu":  # the interpreter never autotunes (``_launch``)
        assert all(choice is None for choice in choices.values())
