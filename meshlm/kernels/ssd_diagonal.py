"""Triton kernels for the diagonal blocks of the SSD scan: the one part that is O(T x chunk).

In the chunked SSD scan (``meshlm/models/ssd_fast.py``; Dao & Gu 2024, §6) every chunk of Q
tokens runs a masked "attention" inside itself, per head h of group g:

    y[l] = sum_{s <= l} (C[l] . B[s]) exp(cs[l] - cs[s]) u[s]          u = dt x, cs = cumsum(dt A)

In PyTorch this materializes the [Q x Q] decay mask and masked scores for every chunk and head
(and again in backward). These kernels never do: one program computes a tile of BLOCK_L
target rows, walking source tiles up to the diagonal, and builds each [BLOCK_L x BLOCK_S] tile
of scores, decays and mask in registers, as ``mamba_ssm``'s ``chunk_scan`` kernels do
(FlashAttention's tiling, with a decay mask instead of a softmax). The decay of a pair is
exp(cs[l] - cs[s]) from the in-chunk cumulative sums (exponents clamped at -80, like the PyTorch
path), so with very strong decays it is less precise than the PyTorch path's segment sums.

The forward also adds the off-diagonal blocks when given the state H [P x N] entering each chunk
(in the run's dtype, or fp32): y[l] += exp(cs[l]) C[l] H^T, so the scan's output is written once, not written by this
kernel and then read, added to and written again (``mamba_ssm``'s ``chunk_scan`` does the same).

``_entering_states_kernel`` passes the state from chunk to chunk, a program per (batch, head, columns)
walking the chunks in order: H_{c+1} = exp(L_c) H_c + st_c, with each chunk's own state
st_c = (w o u)^T B, w = exp(cs_end - cs) (``mamba_ssm``'s ``chunk_state`` and ``state_passing``
in one), so st_c never leaves registers; the running state is fp32 and the entering states are
stored in the run's dtype, as ``mamba_ssm`` stores them for its ``chunk_scan`` (the final state
in fp32). ``_entering_states_backward_kernel`` walks them back:
the gradient of each chunk's state, of the chunks' total decays, and of the initial state, adding
on the way each entering state's gradient from the off-diagonal blocks, dH = (e o dy)^T C with
e = exp(cs).

Backward (same tiling, recomputing scores and decays):

- ``_diagonal_backward_sources``: per source tile s, du[s] = sum_l M[l, s] dy[l],
  dB[s] = sum_h sum_l (dM o L)[l, s] C[l] with dM = dy u^T, and colsum_s(dM o M); given the
  gradient dS of each chunk's state st = (w o u)^T B (w = exp(cs_end - cs)), also that state's
  backward at s: du[s] += w[s] B[s] dS^T, dB[s] += sum_h (w o u)[s] dS and its weight term;
- ``_diagonal_backward_targets``: per target tile l, dC[l] = sum_h sum_s (dM o L)[l, s] B[s] and
  rowsum_l(dM o M); given the entering states H, also the off-diagonal blocks'
  parts, dC[l] += sum_h (e o dy)[l] H and d cs[l] += sum_p (e o dy)[l] o (C[l] H^T), e = exp(cs).

A backward program owns one tile of one B/C group and walks the group's heads, so dB and dC are
summed over the heads in registers and written once per group: written per head, as B and C
are read, they would be heads/groups times B's size in fp32 (8 x at Nemotron-H's 64 heads in 8
groups: 2 GB a layer at 8 x 4096 tokens, written and read again to sum them). The decay gradient
comes as rowsum - colsum on cs (the adjoint of cs[l] - cs[s]). Everything accumulates in fp32; u, B, C
and dy enter the dot products in their own dtype (bf16 in a bf16 run); fp32 tiles multiply in
TF32 only where the run allows TF32 (``_dot_precision``). The output y is written in the run's
dtype, as ``mamba_ssm`` writes it, and its gradient dy comes in it: in a bf16 run the layer's
largest activation ([b, t, heads x head_dim]) and its gradient are half the bytes of fp32 ones,
written once and read by every kernel of the backward.

Tensors are laid out as the PyTorch path lays them out: u, dy [b, h, c, Q, P]; B, C
[b, g, c, Q, N]; cs [b, h, c, Q] (fp32); all contiguous. The kernels need Q, P and N of at least
16 (``tl.dot``'s smallest tile); ``supported`` says whether a call can use them. Tested on CPU with
Triton's interpreter (``TRITON_INTERPRET=1``) against the PyTorch path.
"""

from __future__ import annotations

import torch

from meshlm.kernels import SSD_MIN_LOG_DECAY

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional: everything runs on the PyTorch path without it
    triton = None

BLOCK = 32
"""Rows and columns of one score tile by default; Q must be a multiple of it (or equal to 16)."""

TUNED_TILES = (32, 64)
"""The tiles a CUDA run chooses from, with 4 or 8 warps (``triton.autotune``: each shape's first
call times every choice and keeps the fastest), where Q is a multiple of the largest: a 32 x 32
tile keeps registers free, a 64-row one lets Hopper's warpgroup matmuls run. Elsewhere (the
interpreter) the tile is ``BLOCK``, or what the caller asks for."""
TUNED_WARPS = (4, 8)
"""The warps per program the autotuner tries with each of ``TUNED_TILES``."""


def supported(chunk: int, head_dim: int, state: int, dtype: torch.dtype) -> bool:
    """Whether the kernels take these shapes: chunk Q, head_dim P and state N of at least 16, Q a
    multiple of the tile (or 16), P and N powers of two (whole rows in one tile), a float dtype."""
    power_of_two = lambda value: value >= 16 and value & (value - 1) == 0  # noqa: E731
    return (power_of_two(head_dim) and power_of_two(state) and (chunk % BLOCK == 0 or chunk == 16)
            and dtype in (torch.float32, torch.bfloat16, torch.float16))


STATE_PASSING_WARPS = 8
"""Warps of the state-passing kernels: their [P x N_TILE] fp32 running state and product over 8
warps keep register use low (``bench.ssd_kernel_build``: the chunk-state products took 78 registers
over 8 warps at P 64, N 128 on sm_90a, against 168 over 4)."""
STATE_TILE = 64
"""Columns of the states a state-passing program owns (``_state_tile``)."""


def _tile(chunk: int) -> int:
    return min(BLOCK, chunk)


def _dot_precision() -> str:
    """How ``tl.dot`` multiplies fp32 tiles: as PyTorch's own fp32 matmuls do in this process, in
    TF32 where ``torch.backends.cuda.matmul.allow_tf32`` (``precision.tf32``) allows it, else in
    full fp32 ("ieee"). Triton's default is TF32 always, which put the fp32 kernels ~1e-2 away
    from the PyTorch path on an H200. bf16 and fp16 tiles multiply exactly either way."""
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"


if triton is not None:

    @triton.jit
    def _group_block(block_id, heads_per_group, heads, groups, chunks):
        """The flattened (batch, group, chunk) index of B and C for program ``block_id`` = (batch, head, chunk)."""
        chunk = block_id % chunks
        head = (block_id // chunks) % heads
        batch = block_id // (chunks * heads)
        return (batch * groups + head // heads_per_group) * chunks + chunk

    @triton.jit
    def _state_block(block_id, chunks, state_slots):
        """Where the [P x N] state of program ``block_id`` = (batch, head, chunk) starts, in states
        of ``state_slots`` slots per (batch, head): the chunks' own, or those plus the final one
        (the recurrence's output, read in place); in units of P * N, as int64."""
        return (block_id // chunks).to(tl.int64) * state_slots + block_id % chunks

    @triton.jit
    def _decayed_scores(C_ptr, B_ptr, cs_ptr, rows, cols, N: tl.constexpr, MIN_DECAY: tl.constexpr,
                        DOT: tl.constexpr):
        """(C[rows] . B[cols]) * exp(clamp(cs[rows] - cs[cols])) on and below the diagonal, 0 above;
        fp32 [rows x cols], with the decay factor L for reuse."""
        n = tl.arange(0, N)
        c_tile = tl.load(C_ptr + rows[:, None] * N + n[None, :])
        b_tile = tl.load(B_ptr + cols[:, None] * N + n[None, :])
        scores = tl.dot(c_tile, tl.trans(b_tile), input_precision=DOT)
        cs_rows = tl.load(cs_ptr + rows)
        cs_cols = tl.load(cs_ptr + cols)
        exponent = tl.minimum(tl.maximum(cs_rows[:, None] - cs_cols[None, :], MIN_DECAY), 0.0)
        causal = rows[:, None] >= cols[None, :]
        decay = tl.where(causal, tl.exp(exponent), 0.0)
        return scores * decay, decay

    @triton.jit
    def _diagonal_forward(u_ptr, C_ptr, B_ptr, cs_ptr, H_ptr, y_ptr, y_stride_b, y_stride_h, y_stride_c, y_stride_l,
                          y_stride_p, heads_per_group, heads, groups, chunks,
                          state_slots, Q: tl.constexpr, P: tl.constexpr, N: tl.constexpr, TILE: tl.constexpr,
                          MIN_DECAY: tl.constexpr, DOT: tl.constexpr, HAS_STATES: tl.constexpr):
        block_id, row_tile = tl.program_id(0), tl.program_id(1)  # block_id = (b, h, c) flattened
        group_block = _group_block(block_id, heads_per_group, heads, groups, chunks)
        u_base, cs_base = u_ptr + block_id * Q * P, cs_ptr + block_id * Q
        C_base, B_base = C_ptr + group_block * Q * N, B_ptr + group_block * Q * N
        rows = row_tile * TILE + tl.arange(0, TILE)
        p = tl.arange(0, P)
        acc = tl.zeros((TILE, P), dtype=tl.float32)
        for col_tile in range(0, row_tile + 1):
            cols = col_tile * TILE + tl.arange(0, TILE)
            masked, decay = _decayed_scores(C_base, B_base, cs_base, rows, cols, N, MIN_DECAY, DOT)
            u_tile = tl.load(u_base + cols[:, None] * P + p[None, :])
            acc += tl.dot(masked.to(u_tile.dtype), u_tile, input_precision=DOT)
        if HAS_STATES:  # the off-diagonal blocks: exp(cs[l]) C[l] H^T, H the state entering the chunk
            n = tl.arange(0, N)
            states_base = H_ptr + _state_block(block_id, chunks, state_slots) * P * N
            states = tl.load(states_base + p[:, None] * N + n[None, :])  # [P, N], the run's dtype (or fp32)
            c_rows = tl.load(C_base + rows[:, None] * N + n[None, :]).to(states.dtype)
            read = tl.dot(c_rows, tl.trans(states), input_precision=DOT)
            acc += read * tl.exp(tl.load(cs_base + rows))[:, None]
        # accumulated in fp32, written once in the run's dtype and x's layout (as mamba_ssm's chunk_scan writes it)
        tl.store(y_ptr + _strided_rows(block_id, heads, chunks, y_stride_b, y_stride_h, y_stride_c)
                 + rows[:, None] * y_stride_l + p[None, :] * y_stride_p, acc.to(y_ptr.dtype.element_ty))

    @triton.jit
    def _head_block(group_block, head_in_group, heads_per_group, heads, groups, chunks):
        """The flattened (batch, head, chunk) index of u, dy and cs for head ``head_in_group`` of
        the group of ``group_block`` = (batch, group, chunk)."""
        chunk = group_block % chunks
        group = (group_block // chunks) % groups
        batch = group_block // (chunks * groups)
        return (batch * heads + group * heads_per_group + head_in_group) * chunks + chunk

    @triton.jit
    def _strided_rows(block_id, heads, chunks, stride_b, stride_h, stride_c):
        """The offset of chunk row 0 of program ``block_id`` = (batch, head, chunk) in a tensor viewed
        as [b, h, c, Q, P] with strides (stride_b, stride_h, stride_c, ...) -- x in its own [b, t, h, P]
        layout: (t h P, P, Q h P, h P, 1)."""
        chunk = block_id % chunks
        head = (block_id // chunks) % heads
        batch = block_id // (chunks * heads)
        return batch.to(tl.int64) * stride_b + head * stride_h + chunk.to(tl.int64) * stride_c

    @triton.jit
    def _diagonal_backward_sources(u_ptr, dy_ptr, C_ptr, B_ptr, cs_ptr, dS_ptr, du_ptr, dB_ptr, colsum_ptr,
                                   weight_terms_ptr, dt_ptr, ddt_ptr,
                                   dx_stride_b, dx_stride_h, dx_stride_c, dx_stride_l, dx_stride_p,
                                   heads_per_group, heads, groups, chunks, state_slots,
                                   Q: tl.constexpr, P: tl.constexpr, N: tl.constexpr, TILE: tl.constexpr,
                                   MIN_DECAY: tl.constexpr, DOT: tl.constexpr, HAS_STATE_GRADS: tl.constexpr,
                                   INPUT_GRADS: tl.constexpr):
        group_block, col_tile = tl.program_id(0), tl.program_id(1)  # group_block = (b, g, c) flattened
        C_base, B_base = C_ptr + group_block * Q * N, B_ptr + group_block * Q * N
        cols = col_tile * TILE + tl.arange(0, TILE)
        p, n = tl.arange(0, P), tl.arange(0, N)
        grad_B = tl.zeros((TILE, N), dtype=tl.float32)  # summed over the group's heads
        for head_in_group in range(0, heads_per_group):
            block_id = _head_block(group_block, head_in_group, heads_per_group, heads, groups, chunks)
            u_base, dy_base, cs_base = u_ptr + block_id * Q * P, dy_ptr + block_id * Q * P, cs_ptr + block_id * Q
            u_cols = tl.load(u_base + cols[:, None] * P + p[None, :])
            grad_u = tl.zeros((TILE, P), dtype=tl.float32)
            colsum = tl.zeros((TILE,), dtype=tl.float32)
            for row_tile in range(col_tile, Q // TILE):
                rows = row_tile * TILE + tl.arange(0, TILE)
                masked, decay = _decayed_scores(C_base, B_base, cs_base, rows, cols, N, MIN_DECAY, DOT)
                dy_rows = tl.load(dy_base + rows[:, None] * P + p[None, :])
                grad_u += tl.dot(tl.trans(masked.to(dy_rows.dtype)), dy_rows, input_precision=DOT)
                grad_masked = tl.dot(dy_rows, tl.trans(u_cols), input_precision=DOT)  # [rows x cols] fp32
                c_rows = tl.load(C_base + rows[:, None] * N + n[None, :])
                grad_B += tl.dot(tl.trans((grad_masked * decay).to(c_rows.dtype)), c_rows, input_precision=DOT)
                colsum += tl.sum(grad_masked * masked, axis=0)
            if HAS_STATE_GRADS:  # the chunk state st = (w o u)^T B, w = exp(cs_end - cs), given dS = d st
                weights = tl.exp(tl.load(cs_base + Q - 1) - tl.load(cs_base + cols))
                weighted_u = u_cols.to(tl.float32) * weights[:, None]  # [cols x P]
                grad_states = tl.load(dS_ptr + _state_block(block_id, chunks, state_slots) * P * N
                                      + p[:, None] * N + n[None, :])  # [P, N], the run's dtype (or fp32)
                b_cols = tl.load(B_base + cols[:, None] * N + n[None, :]).to(grad_states.dtype)
                b_states = tl.dot(b_cols, tl.trans(grad_states), input_precision=DOT)  # [cols x P]: B dS^T
                grad_u += b_states * weights[:, None]
                grad_B += tl.dot(weighted_u.to(grad_states.dtype), grad_states, input_precision=DOT)
                weight_terms = tl.sum(weighted_u * b_states, axis=1)  # d w o w, per position
                colsum += weight_terms  # d cs = rowsum - colsum: - d w o w at every position ...
                tl.store(weight_terms_ptr + block_id * Q + cols, weight_terms)  # ... + their sum at the end (caller)
            if INPUT_GRADS:  # u = dt x: dx = du dt, in x's dtype and layout; d dt = sum_p du x = (sum_p du u) / dt
                dt_cols = tl.load(dt_ptr + block_id * Q + cols)  # (u is at hand; x would be one more tile live)
                tl.store(du_ptr + _strided_rows(block_id, heads, chunks, dx_stride_b, dx_stride_h, dx_stride_c)
                         + cols[:, None] * dx_stride_l + p[None, :] * dx_stride_p,
                         (grad_u * dt_cols[:, None]).to(du_ptr.dtype.element_ty, fp_downcast_rounding="rtne"))
                tl.store(ddt_ptr + block_id * Q + cols, tl.sum(grad_u * u_cols.to(tl.float32), axis=1) / dt_cols)
            else:
                tl.store(du_ptr + block_id * Q * P + cols[:, None] * P + p[None, :], grad_u)
            tl.store(colsum_ptr + block_id * Q + cols, colsum)
        tl.store(dB_ptr + group_block * Q * N + cols[:, None] * N + n[None, :], grad_B)

    @triton.jit
    def _diagonal_backward_targets(u_ptr, dy_ptr, C_ptr, B_ptr, cs_ptr, H_ptr, dC_ptr, rowsum_ptr,
                                   heads_per_group, heads, groups, chunks, state_slots,
                                   Q: tl.constexpr, P: tl.constexpr, N: tl.constexpr, TILE: tl.constexpr,
                                   MIN_DECAY: tl.constexpr, DOT: tl.constexpr, HAS_STATES: tl.constexpr):
        group_block, row_tile = tl.program_id(0), tl.program_id(1)
        C_base, B_base = C_ptr + group_block * Q * N, B_ptr + group_block * Q * N
        rows = row_tile * TILE + tl.arange(0, TILE)
        p, n = tl.arange(0, P), tl.arange(0, N)
        grad_C = tl.zeros((TILE, N), dtype=tl.float32)  # summed over the group's heads
        for head_in_group in range(0, heads_per_group):
            block_id = _head_block(group_block, head_in_group, heads_per_group, heads, groups, chunks)
            u_base, dy_base, cs_base = u_ptr + block_id * Q * P, dy_ptr + block_id * Q * P, cs_ptr + block_id * Q
            dy_rows = tl.load(dy_base + rows[:, None] * P + p[None, :])
            rowsum = tl.zeros((TILE,), dtype=tl.float32)
            for col_tile in range(0, row_tile + 1):
                cols = col_tile * TILE + tl.arange(0, TILE)
                masked, decay = _decayed_scores(C_base, B_base, cs_base, rows, cols, N, MIN_DECAY, DOT)
                u_cols = tl.load(u_base + cols[:, None] * P + p[None, :])
                grad_masked = tl.dot(dy_rows, tl.trans(u_cols), input_precision=DOT)
                b_cols = tl.load(B_base + cols[:, None] * N + n[None, :])
                grad_C += tl.dot((grad_masked * decay).to(b_cols.dtype), b_cols, input_precision=DOT)
                rowsum += tl.sum(grad_masked * masked, axis=1)
            if HAS_STATES:  # the off-diagonal blocks y[l] += exp(cs[l]) C[l] H^T
                decayed = dy_rows.to(tl.float32) * tl.exp(tl.load(cs_base + rows))[:, None]  # [rows x P]: e o dy
                states = tl.load(H_ptr + _state_block(block_id, chunks, state_slots) * P * N
                                 + p[:, None] * N + n[None, :])  # [P, N], the run's dtype (or fp32)
                grad_C += tl.dot(decayed.to(states.dtype), states, input_precision=DOT)
                # C H^T after the dC product, not beside it: both at once spill (bench.ssd_kernel_build)
                c_rows = tl.load(C_base + rows[:, None] * N + n[None, :]).to(states.dtype)
                read = tl.dot(c_rows, tl.trans(states), input_precision=DOT)  # [rows x P]: C H^T
                rowsum += tl.sum(decayed * read, axis=1)  # the off-diagonal part of d cs
            tl.store(rowsum_ptr + block_id * Q + rows, rowsum)
        tl.store(dC_ptr + group_block * Q * N + rows[:, None] * N + n[None, :], grad_C)

    @triton.jit
    def _decayed_product(a_base, b_base, cs_base, n, Q: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
                         N_TILE: tl.constexpr, TILE: tl.constexpr, DOT: tl.constexpr, FROM_START: tl.constexpr):
        """(w o a)^T b [P x N_TILE] for one (batch, head, chunk): a [Q, P] of the head, columns ``n``
        of b [Q, N] of its group, w = exp(cs) (FROM_START) or exp(cs_end - cs); w and w o a
        rounded to a's dtype (no rounding for fp32 a) as the PyTorch path rounds them, the
        products accumulated in fp32."""
        p = tl.arange(0, P)
        cs_end = tl.load(cs_base + Q - 1)
        acc = tl.zeros((P, N_TILE), dtype=tl.float32)
        for tile in range(0, Q // TILE):
            rows = tile * TILE + tl.arange(0, TILE)
            a_rows = tl.load(a_base + rows[:, None] * P + p[None, :])
            cs_rows = tl.load(cs_base + rows)
            exponent = cs_rows if FROM_START else cs_end - cs_rows
            # a bf16 product is the fp32 product rounded to nearest
            weights = tl.exp(exponent).to(a_rows.dtype, fp_downcast_rounding="rtne").to(tl.float32)
            weighted = (a_rows.to(tl.float32) * weights[:, None]).to(a_rows.dtype, fp_downcast_rounding="rtne")
            b_rows = tl.load(b_base + rows[:, None] * N + n[None, :]).to(a_rows.dtype)
            acc += tl.dot(tl.trans(weighted), b_rows, input_precision=DOT)
        return acc

    @triton.jit
    def _state_columns(start_ptr, P: tl.constexpr, N: tl.constexpr, N_TILE: tl.constexpr, HAS_START: tl.constexpr):
        """For program (head_row, n_tile) of a state-passing kernel: its head row, its columns ``n``
        of the [P x N] states, their offsets in one state, and its columns of the state the walk
        starts from, [P x N_TILE] fp32 (read from ``start_ptr`` [b * h, P, N] if HAS_START, else 0)."""
        head_row, n_tile = tl.program_id(0), tl.program_id(1)  # head_row = (b, h) flattened
        p, n = tl.arange(0, P), n_tile * N_TILE + tl.arange(0, N_TILE)
        offsets = p[:, None] * N + n[None, :]
        if HAS_START:
            start = tl.load(start_ptr + head_row.to(tl.int64) * P * N + offsets)
        else:
            start = tl.zeros((P, N_TILE), dtype=tl.float32)
        return head_row, n, offsets, start

    @triton.jit
    def _entering_states_kernel(u_ptr, B_ptr, cs_ptr, initial_ptr, out_ptr, final_ptr, heads_per_group, heads,
                                groups, chunks, Q: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
                                N_TILE: tl.constexpr, TILE: tl.constexpr, DOT: tl.constexpr,
                                HAS_INITIAL: tl.constexpr):
        """The states entering each chunk of one (batch, head), columns ``n`` of them: slot c of
        out [c, P, N] is H_c (rounded to out's dtype), H_0 the initial state (or 0), H_{c+1} =
        exp(L_c) H_c + st_c with st_c = (w o u_c)^T B_c the chunk's own state and L_c = cs_end its
        total log-decay; the final state H_c goes to ``final`` in fp32. Walks the chunks in order,
        the running state in fp32 (rounding a stored copy never feeds back); st_c never leaves registers."""
        head_row, n, offsets, running = _state_columns(initial_ptr, P, N, N_TILE, HAS_INITIAL)
        out_base = out_ptr + head_row.to(tl.int64) * chunks * P * N
        for chunk in range(0, chunks):
            tl.store(out_base + chunk * P * N + offsets, running.to(out_ptr.dtype.element_ty))
            block_id = head_row * chunks + chunk
            group_block = _group_block(block_id, heads_per_group, heads, groups, chunks)
            cs_base = cs_ptr + block_id.to(tl.int64) * Q
            own = _decayed_product(u_ptr + block_id.to(tl.int64) * Q * P, B_ptr + group_block.to(tl.int64) * Q * N,
                                   cs_base, n, Q, P, N, N_TILE, TILE, DOT, False)
            running = running * tl.exp(tl.load(cs_base + Q - 1)) + own
        tl.store(final_ptr + head_row.to(tl.int64) * P * N + offsets, running)

    @triton.jit
    def _entering_states_backward_kernel(dy_ptr, C_ptr, cs_ptr, H_ptr, final_grad_ptr, state_grads_ptr,
                                         log_terms_ptr, initial_grad_ptr, heads_per_group, heads, groups, chunks,
                                         state_slots, Q: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
                                         N_TILE: tl.constexpr, TILE: tl.constexpr, DOT: tl.constexpr,
                                         HAS_FINAL_GRAD: tl.constexpr):
        """The adjoint of ``_entering_states_kernel`` for one (batch, head), columns ``n``, walking
        the chunks backwards: G, the gradient of slot c + 1 (the final state's to start with), is
        chunk c's state gradient; L_c receives exp(L_c) sum(G o H_c) (this tile's part, to
        ``log_terms`` [c, N / N_TILE]); then G <- exp(L_c) G + dH_c with dH_c = (e o dy_c)^T C_c,
        e = exp(cs), the off-diagonal blocks' gradient of H_c. What is left is the initial state's."""
        head_row, n, offsets, grad = _state_columns(final_grad_ptr, P, N, N_TILE, HAS_FINAL_GRAD)
        for step in range(0, chunks):
            block_id = head_row * chunks + chunks - 1 - step
            tl.store(state_grads_ptr + block_id.to(tl.int64) * P * N + offsets, grad.to(state_grads_ptr.dtype.element_ty))
            entering = tl.load(H_ptr + _state_block(block_id, chunks, state_slots) * P * N + offsets).to(tl.float32)
            cs_base = cs_ptr + block_id.to(tl.int64) * Q
            decay = tl.exp(tl.load(cs_base + Q - 1))
            tl.store(log_terms_ptr + block_id.to(tl.int64) * tl.num_programs(1) + tl.program_id(1),
                     decay * tl.sum(tl.sum(grad * entering, axis=1), axis=0))
            group_block = _group_block(block_id, heads_per_group, heads, groups, chunks)
            off_diagonal = _decayed_product(dy_ptr + block_id.to(tl.int64) * Q * P,
                                            C_ptr + group_block.to(tl.int64) * Q * N, cs_base, n, Q, P, N,
                                            N_TILE, TILE, DOT, True)
            grad = grad * decay + off_diagonal
        tl.store(initial_grad_ptr + head_row.to(tl.int64) * P * N + offsets, grad)

    _TUNING = [triton.Config({"TILE": tile}, num_warps=warps) for tile in TUNED_TILES for warps in TUNED_WARPS]
    _tuned = triton.autotune(configs=_TUNING, key=["heads_per_group", "Q", "P", "N"])
    _diagonal_forward_tuned = _tuned(_diagonal_forward)
    _diagonal_backward_sources_tuned = _tuned(_diagonal_backward_sources)
    _diagonal_backward_targets_tuned = _tuned(_diagonal_backward_targets)


def _tunes(chunk: int, on_cuda: bool) -> bool:
    """Whether a call picks its tile with the autotuner: on CUDA, where the chunk takes every tuned tile."""
    return on_cuda and chunk % max(TUNED_TILES) == 0


def kernel_choices(chunk: int, on_cuda: bool) -> list[tuple[int | None, int | None]]:
    """Every (tile, warps) the diagonal kernels may run a chunk of ``chunk`` tokens with: each
    autotuner choice where a call is tuned, else the default alone, (None, None). What a check of
    the kernels on a device must cover (``meshlm/models/scan_kernels.py``): the autotuner picks
    by speed, per shape, so any of them may be the one a run gets."""
    if _tunes(chunk, on_cuda):
        return [(tile, warps) for tile in TUNED_TILES for warps in TUNED_WARPS]
    return [(None, None)]


def _launch(kernel, tuned, programs: int, chunk: int, tile: int | None, warps: int | None, on_cuda: bool, *args,
            **constants) -> None:
    """Run ``kernel`` over ``programs`` x (chunk / tile) programs: its autotuned form ``tuned``
    (over ``TUNED_TILES``) on CUDA when the chunk takes every tuned tile and neither ``tile`` nor
    ``warps`` is asked for; else with ``tile`` (default ``BLOCK``, at most the chunk) and ``warps``
    (default Triton's, 4)."""
    constants.update(MIN_DECAY=SSD_MIN_LOG_DECAY, DOT=_dot_precision())
    if tile is None and warps is None and _tunes(chunk, on_cuda):
        tuned[lambda meta: (programs, chunk // meta["TILE"])](*args, **constants)
        return
    tile = tile or _tile(chunk)
    if chunk % tile:
        raise ValueError(f"a tile of {tile} rows does not divide the chunk of {chunk}")
    kernel[(programs, chunk // tile)](*args, TILE=tile, num_warps=warps or 4, **constants)


def tuned_choices() -> dict[str, str | None]:
    """The tile and warps the autotuner last chose for each kernel in this process (``None``: it has
    not run, e.g. off CUDA or where a compiled graph tuned its own copy); for benchmark records."""
    if triton is None:
        return {}
    tuned = {"forward": _diagonal_forward_tuned, "backward_sources": _diagonal_backward_sources_tuned,
             "backward_targets": _diagonal_backward_targets_tuned}
    return {name: (None if getattr(kernel, "best_config", None) is None else str(kernel.best_config))
            for name, kernel in tuned.items()}


def _require_fp32_contiguous(**tensors: torch.Tensor | None) -> None:
    """States are read as flat contiguous fp32 blocks; None is an operand not given."""
    for name, tensor in tensors.items():
        if tensor is not None and (tensor.dtype != torch.float32 or not tensor.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous fp32 tensor")


def _state_slots(name: str, states: torch.Tensor | None, chunks: int) -> int:
    """How many [P x N] slots per (batch, head) lie between the (batch, head) rows of ``states``
    [b, h, c, P, N] (fp32): c when contiguous; more when they are the first c slots (or any c
    consecutive ones) of a contiguous [b, h, slots, P, N] tensor, such as the PyTorch recurrence's
    output with the final state after the chunks' -- read in place, not copied. None: any. In fp32,
    bf16 or fp16: the kernels multiply them in their own dtype (``STATE_DTYPES``)."""
    if states is None:
        return chunks
    head_dim, state = states.shape[-2:]
    block = head_dim * state
    strides = states.stride()
    slots = strides[1] // block if block else 0
    if (states.dtype not in STATE_DTYPES or states.dim() != 5 or strides[2:] != (block, state, 1)
            or strides[1] != slots * block or slots < chunks
            or (states.shape[0] > 1 and strides[0] != states.shape[1] * strides[1])):
        raise ValueError(f"{name} must be states [b, h, c, P, N] in fp32, bf16 or fp16, contiguous or c "
                         "consecutive slots of a contiguous [b, h, slots, P, N] tensor")
    return slots


STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""What the states between chunks and their gradients may be stored in: the run's dtype, as the
scan's Triton path stores them (``entering_states``), or fp32."""


def _layout(u: torch.Tensor, B: torch.Tensor) -> tuple[int, ...]:
    batch, heads, chunks, chunk, head_dim = u.shape
    groups, state = B.shape[1], B.shape[4]
    return batch, heads, chunks, chunk, head_dim, groups, state


def diagonal_forward(u: torch.Tensor, C: torch.Tensor, B: torch.Tensor, cs: torch.Tensor,
                     start_states: torch.Tensor | None = None, tile: int | None = None,
                     warps: int | None = None) -> torch.Tensor:
    """y [b, h, c, Q, P] = (C B^T o L) u per chunk and head (module docstring), accumulated in fp32
    and written in u's dtype and in x's own layout [b, c Q, h, P] (returned as its [b, h, c, Q, P]
    view: the scan's output needs no copy to return to it), plus, given the
    states entering each chunk ``start_states`` [b, h, c, P, N] (in u's dtype or fp32; contiguous,
    or c consecutive slots of a contiguous [b, h, slots, P, N]: ``_state_slots``), the off-diagonal
    blocks exp(cs) C H^T: the scan's whole output in one write. ``tile`` and ``warps`` fix the score
    tile's rows and the warps (default: tuned on CUDA, ``BLOCK`` and 4 elsewhere; ``kernel_choices``)."""
    batch, heads, chunks, chunk, head_dim, groups, state = _layout(u, B)
    natural = torch.empty(batch, chunks * chunk, heads, head_dim, dtype=u.dtype, device=u.device)
    slots = _state_slots("start_states", start_states, chunks)
    _launch(_diagonal_forward, _diagonal_forward_tuned, batch * heads * chunks, chunk, tile, warps, u.is_cuda,
            u, C, B, cs, natural if start_states is None else start_states, natural,
            *_natural_strides(batch, heads, chunks, chunk, head_dim), heads // groups, heads, groups, chunks,
            slots, Q=chunk, P=head_dim, N=state, HAS_STATES=start_states is not None)
    return _chunked_view(natural, chunks, chunk)


def _natural_strides(batch: int, heads: int, chunks: int, chunk: int, head_dim: int) -> tuple[int, ...]:
    """The strides, as [b, h, c, Q, P], of a contiguous [b, c Q, h, P] tensor: x's own layout, in
    which the kernels write y and dx (a kernel gets the contiguous tensor and these strides, not a
    strided view, which a compiled graph could lay out otherwise)."""
    return (chunks * chunk * heads * head_dim, head_dim, chunk * heads * head_dim, heads * head_dim, 1)


def _chunked_view(natural: torch.Tensor, chunks: int, chunk: int) -> torch.Tensor:
    """[b, c Q, h, P] viewed as [b, h, c, Q, P] (the inverse of ``ssd_fast._from_per_head_chunks``)."""
    batch, _, heads, head_dim = natural.shape
    return natural.view(batch, chunks, chunk, heads, head_dim).permute(0, 3, 1, 2, 4)


def _state_tile(state: int) -> int:
    """Columns of the [P x N] states one state-passing program owns: 64 at most (twice the programs
    at N = 128: 1024 for 8 sequences of 64 heads), all of N below."""
    return min(state, STATE_TILE)


def entering_states(u: torch.Tensor, B: torch.Tensor, cs: torch.Tensor,
                    initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The state entering each chunk, [b, h, c, P, N] in u's dtype, and the final state [b, h, P, N]
    in fp32: H_0 the initial state [b, h, P, N] (fp32, contiguous; None: zeros), H_{c+1} =
    exp(L_c) H_c + st_c with st_c = (w o u_c)^T B_c (w = exp(cs_end - cs), rounded as
    ``ssd_fast._Pieces`` rounds w and w o u; L_c = cs_end). The recurrence runs in fp32; only the
    stored entering states are rounded, to the dtype the off-diagonal blocks multiply them in (as
    ``mamba_ssm``'s state passing hands them to its ``chunk_scan``): in bf16 they are half the
    bytes to write, save for backward and read back. One program per (batch, head) and column
    tile walks the chunks in order, so the chunk states st_c stay in registers: the PyTorch path
    writes them ([b, h, c, P, N] fp32) and reads them back for a matmul with the chunks' decay
    matrix, the same sums in another order."""
    batch, heads, chunks, chunk, head_dim, groups, state = _layout(u, B)
    out = torch.empty(batch, heads, chunks, head_dim, state, dtype=u.dtype, device=u.device)
    final = torch.empty(batch, heads, head_dim, state, dtype=torch.float32, device=u.device)
    _require_fp32_contiguous(initial_state=initial_state)
    tile = _state_tile(state)
    _entering_states_kernel[(batch * heads, state // tile)](
        u, B, cs, final if initial_state is None else initial_state, out, final, heads // groups, heads, groups,
        chunks, Q=chunk, P=head_dim, N=state, N_TILE=tile, TILE=_tile(chunk), DOT=_dot_precision(),
        HAS_INITIAL=initial_state is not None, num_warps=STATE_PASSING_WARPS)
    return out, final


def entering_states_backward(dy: torch.Tensor, C: torch.Tensor, cs: torch.Tensor, start_states: torch.Tensor,
                             final_grad: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of ``entering_states`` and of the off-diagonal blocks y[l] += exp(cs[l]) C[l] H^T
    through the entering states H: for dy [b, h, c, Q, P] (contiguous; in the run's dtype, e o dy
    rounded to it as ``_decayed_product`` says, the products in fp32), the entering states
    ``start_states`` (as ``diagonal_forward`` took them) and the final state's gradient ``final_grad``
    [b, h, P, N] (fp32, contiguous; None: 0), returns each chunk state's gradient [b, h, c, P, N]
    (in dy's dtype, as ``entering_states`` stores the states; walked back in fp32), the total
    log-decays' [b, h, c] (fp32, from the recurrence: sum(G o exp(L_c) H_c)) and the initial
    state's [b, h, P, N] (fp32). The off-diagonal blocks' own gradient of each H_c, (e o dy)^T C,
    is made and added in registers (it was a [b, h, c, P, N] tensor before the recurrence's matmul)."""
    if not dy.is_contiguous() or dy.dtype != C.dtype:
        raise ValueError(f"entering_states_backward takes dy contiguous in C's dtype ({C.dtype}), got {dy.dtype}")
    batch, heads, chunks, chunk, head_dim, groups, state = _layout(dy, C)
    _require_fp32_contiguous(final_grad=final_grad)
    slots = _state_slots("start_states", start_states, chunks)
    tile = _state_tile(state)
    state_grads = torch.empty(batch, heads, chunks, head_dim, state, dtype=dy.dtype, device=dy.device)
    log_terms = torch.empty(batch, heads, chunks, state // tile, dtype=torch.float32, device=dy.device)
    initial_grad = torch.empty(batch, heads, head_dim, state, dtype=torch.float32, device=dy.device)
    _entering_states_backward_kernel[(batch * heads, state // tile)](
        dy, C, cs, start_states, initial_grad if final_grad is None else final_grad, state_grads, log_terms,
        initial_grad, heads // groups, heads, groups, chunks, slots, Q=chunk, P=head_dim, N=state, N_TILE=tile,
        TILE=_tile(chunk), DOT=_dot_precision(), HAS_FINAL_GRAD=final_grad is not None,
        num_warps=STATE_PASSING_WARPS)
    return state_grads, log_terms.sum(-1), initial_grad


def diagonal_backward(u: torch.Tensor, C: torch.Tensor, B: torch.Tensor, cs: torch.Tensor,
                      dy: torch.Tensor, start_states: torch.Tensor | None = None,
                      state_grads: torch.Tensor | None = None,
                      tile: int | None = None, warps: int | None = None,
                      dt: torch.Tensor | None = None) -> tuple[torch.Tensor | None, ...]:
    """Gradients of ``diagonal_forward`` for dy [b, h, c, Q, P] (contiguous, in u's dtype, as the
    output y is): du [b, h, c, Q, P], dB and dC per group [b, g, c, Q, N] (B's and C's shape),
    d cs [b, h, c, Q], all fp32, the chunk states' weight terms (below; None without
    ``state_grads``), and None.

    Given ``dt`` ([b, h, c, Q], fp32) of u = dt x, the first result is dx = du dt instead of du, in
    u's dtype (x's), laid out as x is, [b, c Q, h, P] (returned as its [b, h, c, Q, P] view), and
    the last is dt's part sum_p du x, fp32 [b, h, c, Q], taken as (sum_p du u) / dt from the u the
    kernel holds (within one rounding of u, 2^-9 relative in bf16, of the sum over x): du (fp32,
    twice u's bytes) is then never written and read back, as ``mamba_ssm``'s chunk-scan backward
    writes dx and d dt itself.

    Given ``start_states`` (as ``diagonal_forward`` took them), dC and d cs also hold the
    off-diagonal blocks' parts, sum_p (e o dy) H and sum_p (e o dy) o (C H^T)
    with e = exp(cs); the states' own gradient, sum_l (e o dy)^T C, is left to the caller (a sum
    over the whole chunk, which no tile holds). Given ``state_grads`` [b, h, c, P, N] (in u's
    dtype or fp32), the gradient dS of each chunk's state st = (w o u)^T B with
    w = exp(cs_end - cs): du += w o (B dS^T),
    dB += sum_h (w o u) dS, and d cs -= t with t = sum_p (w o u) o (B dS^T), the weight terms
    returned, whose sum over the chunk the caller adds to each chunk's last d cs. ``tile`` and
    ``warps`` as ``diagonal_forward``'s."""
    batch, heads, chunks, chunk, head_dim, groups, state = _layout(u, B)
    input_grads = dt is not None
    if input_grads:  # dx in x's natural layout [b, t, h, P], written through its chunked view
        if dt.shape != cs.shape or dt.dtype != torch.float32 or not dt.is_contiguous():
            raise ValueError(f"diagonal_backward takes dt contiguous in fp32 and shaped as cs {tuple(cs.shape)}; "
                             f"got {tuple(dt.shape)} {dt.dtype}")
        grad_x = torch.empty(batch, chunks * chunk, heads, head_dim, dtype=u.dtype, device=u.device)
        grad_dt = torch.empty(cs.shape, dtype=torch.float32, device=u.device)
        strides = _natural_strides(batch, heads, chunks, chunk, head_dim)
    else:
        grad_x = grad_dt = None
        grad_u = torch.empty(u.shape, dtype=torch.float32, device=u.device)
        strides = grad_u.stride()
    grad_B = torch.empty(B.shape, dtype=torch.float32, device=u.device)
    grad_C = torch.empty_like(grad_B)
    colsum = torch.empty(cs.shape, dtype=torch.float32, device=u.device)
    rowsum = torch.empty_like(colsum)
    has_states = start_states is not None
    if not dy.is_contiguous() or dy.dtype != u.dtype:
        raise ValueError(f"diagonal_backward takes dy contiguous in u's dtype ({u.dtype}), got {dy.dtype}")
    programs = batch * groups * chunks  # one program per group's tile: it walks the group's heads
    shapes = dict(Q=chunk, P=head_dim, N=state)
    start_slots = _state_slots("start_states", start_states, chunks)
    grad_slots = _state_slots("state_grads", state_grads, chunks)
    weight_terms = None if state_grads is None else torch.empty_like(colsum)
    _launch(_diagonal_backward_sources, _diagonal_backward_sources_tuned, programs, chunk, tile, warps, u.is_cuda,
            u, dy, C, B, cs, colsum if state_grads is None else state_grads, grad_x if input_grads else grad_u,
            grad_B, colsum, colsum if weight_terms is None else weight_terms, dt if input_grads else cs,
            grad_dt if input_grads else colsum, *strides,
            heads // groups, heads, groups, chunks, grad_slots,
            HAS_STATE_GRADS=state_grads is not None, INPUT_GRADS=input_grads, **shapes)
    _launch(_diagonal_backward_targets, _diagonal_backward_targets_tuned, programs, chunk, tile, warps, u.is_cuda,
            u, dy, C, B, cs, start_states if has_states else dy, grad_C, rowsum,
            heads // groups, heads, groups, chunks, start_slots, HAS_STATES=has_states, **shapes)
    if input_grads:
        grad_u = _chunked_view(grad_x, chunks, chunk)  # dx, as [b, h, c, Q, P]
    return grad_u, grad_B, grad_C, rowsum - colsum, weight_terms, grad_dt


__all__ = ["diagonal_backward", "diagonal_forward", "entering_states", "entering_states_backward", "kernel_choices",
           "supported", "tuned_choices"]
