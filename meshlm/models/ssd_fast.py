"""The SSD scan as one autograd function: matmuls in the run's dtype, groups never expanded,
nothing of size [chunk x chunk] kept for backward.

``ssd.ssd_chunked_scan`` is the reference: four einsum steps in fp32, differentiated by
autograd. Autograd keeps everything it needs for the backward -- the [Q x Q] decay masks and
scores of every chunk and head, B and C repeated for every head, fp32 copies of the inputs --
22-38 times the bytes of the input x, and the einsums spend as long permuting and copying as
multiplying. This module computes the same function (Dao & Gu 2024, §6, the SSD algorithm; the
notation of ``ssd.py``) the way the fused kernels of ``mamba_ssm`` do, in PyTorch:

- **Layout.** Per-head tensors are laid out [b, h, c, l, ...] (batch, head, chunk, position)
  and B, C [b, g, c, l, n] once, so each step is one batched matmul over contiguous blocks.
  Heads sharing a B/C group are handled by broadcasting the group's tensor, never by copying
  it per head; the scores C B^T are computed once per group.
- **Decays.** Inside a chunk of Q tokens the decay mask exp(a_{s+1} + ... + a_l) sums each
  segment's own terms (``ssd.segment_sum``'s way; a difference cs_l - cs_s of cumulative sums
  loses precision when decays are strong) and clamps the exponent at -80, off the slow path of
  exp for underflowing results. Decays from a chunk's start or to its end use cs, the
  cumulative sum of a from the chunk's start.
- **Dtypes.** u = dt x, the scores, the masked scores and the diagonal-block product run in
  the inputs' dtype (bf16 in a bf16 run: half the bytes and the fast matmuls); decays, the
  chunk states and the inter-chunk recurrence are fp32. The output y is summed in fp32 and
  rounded once to the inputs' dtype, as ``mamba_ssm``'s kernels write it (the mixer adds the D
  skip and normalizes in fp32): y and its gradient are the layer's largest tensors, [b, t,
  heads x head_dim], and in bf16 they move half the bytes of fp32 ones.
- **Backward by hand, with recomputation.** Only the inputs and the fp32 state entering each
  chunk ([b, h, c, p, n]: N/Q of the input's size per token, times 4 bytes) are saved. The
  backward recomputes u, the cumulative decays, the scores and the decay mask one layer at a
  time and applies the adjoint of each step:

  * diagonal blocks y = M u with M = (C B^T) o L:  du = M^T dy, dM = dy u^T,
    d(C B^T) = sum over the group's heads of dM o L, and dM o M, the gradient of every
    segment sum a_{s+1} + ... + a_l, which a_k receives from the segments holding it
    (partial sums over s < k, then a sum over l >= k);
  * chunk states st = (w o u)^T B with w_l = exp(cs_end - cs_l): du += w o (B st'^T),
    dB += (w o u) st', and (w o u o B st'^T) summed over p gives w's gradient;
  * off-diagonal blocks y_off = exp(cs_l) C H^T: dH = (e o dy)^T C, dC += (e o dy) H,
    and cs_l receives sum_p dy o y_off;
  * the recurrence H_{c+1} = exp(L_c) H_c + st_c between chunks, in matrix form
    G = Decay^T [dH; d final]: G_{c+1} is the gradient of st_c, G_0 that of the initial state,
    and L_c receives sum(G_{c+1} o exp(L_c) H_c);
  * cs is a cumulative sum of a = dt A (its adjoint a reverse cumulative sum), and u = dt x.

The result equals ``ssd_chunked_scan`` up to rounding in fp32 (tests/models/test_ssd_fast.py:
1e-5 relative, values and gradients) and within bf16 rounding in bf16.

**The Triton path** (``use_triton``, ``meshlm/kernels/ssd_diagonal.py``) computes the same steps
with kernels instead of the matmuls: the chunk states together with the recurrence (one pass over
the chunks), and the diagonal blocks plus the off-diagonal read in the forward (so y is written
once); in backward the recurrence walked back together with the entering states' gradient from
the off-diagonal blocks, then the diagonal blocks' gradients together with the off-diagonal parts
of dC and d cs and the chunk states' backward, whose first kernel also turns du into dx = du dt
(in x's dtype and layout) and dt's part sum_p du x: the fp32 du is never stored. No fp32 copy of
a per-head tensor is made for a matmul. The recurrences run in fp32 inside the kernels; the states entering the chunks and their
gradients pass from kernel to kernel in the run's dtype, as ``mamba_ssm`` passes them (the final
state and the initial state's gradient stay fp32): in bf16, half the bytes of the [b, h, c, P, N]
tensors that are written, saved for backward and read back several times.

**Packed documents** (``document_ids``): the four 0/1 factors of ``ssd.DocumentMasks`` multiply
the decay mask L, the weights w, the chunk decay matrix and exp(cs_l) of the off-diagonal read,
in forward and backward alike (they are constants); the recurrence's gradient of L_c takes the
factor of chunk c's link too. The Triton diagonal-block kernels take no masks, so they are not
selected when documents are given (``use_triton`` None or True): the PyTorch path runs instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from meshlm.errors import ConfigError
from meshlm.kernels import SSD_MIN_LOG_DECAY, triton_installed
from meshlm.models.function_outputs import distinct_output
from meshlm.models.ssd import DocumentMasks, split_into_chunks, segment_sum


def _per_head_view(tensor: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[b, t, h, ...] -> [b, h, c, l, ...] (zero-padded to whole chunks; a view when no padding is needed)."""
    chunked = split_into_chunks(tensor, chunk_size)  # [b, c, l, h, ...]
    return chunked.permute((0, 3, 1, 2) + tuple(range(4, chunked.dim())))


def _per_head_chunks(tensor: torch.Tensor, chunk_size: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``_per_head_view`` copied once into a contiguous tensor of ``dtype``."""
    view = _per_head_view(tensor, chunk_size)
    return torch.empty(view.shape, dtype=dtype or tensor.dtype, device=view.device).copy_(view)


def _from_per_head_chunks(tensor: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[b, h, c, l, ...] -> [b, t, h, ...], the padding cut off (the inverse of ``_per_head_chunks``)."""
    order = (0, 2, 3, 1) + tuple(range(4, tensor.dim()))
    return tensor.permute(order).flatten(1, 2)[:, :seq_len]


class _Pieces:
    """The recomputable pieces of the scan, shared by forward and backward (see the module docstring).

    u [b, h, c, l, p] = dt x (run dtype); cs [b, h, c, l] fp32 cumulative log-decays from each
    chunk's start; B, C [b, g, c, l, n] (run dtype); the grouped views split h into [g, j].
    """

    def __init__(self, x, dt, A, B, C, chunk_size: int, document_ids: torch.Tensor | None = None):
        self.documents = None if document_ids is None else DocumentMasks(document_ids, chunk_size)
        self.batch, self.seq_len, self.heads, self.head_dim = x.shape
        self.groups, self.state_size = B.shape[2], B.shape[3]
        if self.heads % self.groups:
            raise ValueError(f"{self.groups} B/C groups do not divide {self.heads} heads")
        self.per_group = self.heads // self.groups
        self.chunk_size, self.dtype = chunk_size, x.dtype
        self.compute = torch.promote_types(x.dtype, torch.float32)  # decays and states: fp32 (fp64 for fp64)
        self.dt = _per_head_chunks(dt, chunk_size, self.compute)  # [b, h, c, l]
        self.x = _per_head_view(x, chunk_size)  # [b, h, c, l, p], strided
        self.u = torch.empty(self.x.shape, dtype=x.dtype, device=x.device)  # contiguous, for the matmuls
        torch.mul(self.x, self.dt[..., None], out=self.u)
        self.log_decay = self.dt * A.to(self.compute)[:, None, None]  # [b, h, c, l]: a = dt A
        self.cs = self.log_decay.cumsum(-1)
        self.B = _per_head_chunks(B, chunk_size, x.dtype)  # [b, g, c, l, n]
        self.C = _per_head_chunks(C, chunk_size, x.dtype)

    def grouped(self, tensor: torch.Tensor) -> torch.Tensor:
        """A per-head tensor [b, h, ...] viewed as [b, g, j, ...] (head h = g * per_group + j)."""
        return tensor.view(self.batch, self.groups, self.per_group, *tensor.shape[2:])

    def by_head(self, tensor: torch.Tensor) -> torch.Tensor:
        """The inverse of ``grouped``."""
        return tensor.reshape(self.batch, self.heads, *tensor.shape[3:])

    def decay_mask(self) -> torch.Tensor:
        """exp(a_{s+1} + ... + a_l) [b, h, c, l, s], fp32, with the exponent clamped at -80.

        Only the lower triangle (s <= l) is used: the upper one is 1 (an empty sum) and the causal
        zeros come from ``causal_scores``. Each segment sum is a cumulative sum of its own terms
        (``ssd.segment_sum``), not a difference cs_l - cs_s of two long sums, which would lose
        precision when decays are strong. Clamping keeps exp() on normal floats: the vectorized
        exp is several times slower on results that underflow (a decay below e^-80 is 1.8e-35
        instead of smaller, far below fp32's resolution of the sums it enters).
        """
        mask = segment_sum(self.log_decay, above=0.0).clamp_(min=SSD_MIN_LOG_DECAY).exp_()
        return mask if self.documents is None else mask.mul_(self.documents.within_chunk())

    def causal_scores(self) -> torch.Tensor:
        """C_l . B_s [b, g, c, l, s] on and below the diagonal, 0 above (once per group, run dtype)."""
        scores = torch.matmul(self.C, self.B.transpose(-1, -2))
        return scores.masked_fill_(self.above_diagonal(), 0.0)

    def above_diagonal(self) -> torch.Tensor:
        length = self.chunk_size
        return torch.ones(length, length, dtype=torch.bool, device=self.cs.device).triu(1)

    def masked_scores(self, decay_mask: torch.Tensor) -> torch.Tensor:
        """M [b, h, c, l, s] = (C_l . B_s) L[l, s] causally, in the run dtype."""
        masked = self.grouped(decay_mask) * self.causal_scores()[:, :, None]
        return self.by_head(masked).to(self.dtype)

    def decay_to_end(self) -> torch.Tensor:
        """w [b, h, c, l] = exp(cs_end - cs_l): position l's decay to the end of its chunk."""
        weights = torch.exp(self.cs[..., -1:] - self.cs)
        return weights if self.documents is None else weights.mul_(self.documents.to_chunk_end())

    def decay_from_start(self) -> torch.Tensor:
        """exp(cs_l) [b, h, c, l]: the decay of the state entering a chunk to position l."""
        decays = self.cs.exp()
        return decays if self.documents is None else decays.mul_(self.documents.from_chunk_start())

    def chunk_decay_matrix(self) -> torch.Tensor:
        """``_chunk_decay_matrix`` of this scan's chunks, zero between slots of different documents."""
        decay = _chunk_decay_matrix(self.chunk_log_decays())
        return decay if self.documents is None else decay.mul_(self.documents.between_slots())

    def chunk_log_decays(self) -> torch.Tensor:
        """[b, h, c]: the total log-decay of every chunk."""
        return self.cs[..., -1]

    def chunk_states(self, weighted_u: torch.Tensor) -> torch.Tensor:
        """st [b, h, c, p, n] = sum_l (w u)[l, p] B[l, n], each chunk's state from a zero start; fp32."""
        states = torch.einsum("bgjclp,bgcln->bgjcpn", self.grouped(weighted_u).to(self.compute),
                              self.B.to(self.compute))
        return self.by_head(states)

    def read_states(self, states: torch.Tensor) -> torch.Tensor:
        """[b, h, c, l, p] = C_l H_c^T (no decay), fp32, for states H [b, h, c, p, n]."""
        return self.by_head(torch.einsum("bgcln,bgjcpn->bgjclp", self.C.to(self.compute), self.grouped(states)))


def _chunk_decay_matrix(chunk_log_decays: torch.Tensor) -> torch.Tensor:
    """[b, h, c+1, c+1]: entry [z, k] = exp(L_k + ... + L_{z-1}), the decay from slot k to slot z
    (slot 0 the initial state, slot k+1 chunk k's state); 0 for k > z."""
    return torch.exp(segment_sum(F.pad(chunk_log_decays, (1, 0))))


def _triton_kernels():
    """meshlm/kernels/ssd_diagonal.py, imported on first use (it imports Triton)."""
    from meshlm.kernels import ssd_diagonal
    return ssd_diagonal


def _diagonal_backward(pieces: _Pieces, dy: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Gradients of the diagonal blocks y = M u, M = (C B^T) o L, in PyTorch: du [b, h, c, l, p],
    dB, dC [b, g, c, l, n] and the log-decays' d a [b, h, c, l] (module docstring)."""
    dtype, compute = pieces.dtype, pieces.compute
    decay_mask = pieces.decay_mask()
    masked = pieces.masked_scores(decay_mask)
    dy_run = dy.to(dtype)
    grad_u = torch.matmul(masked.transpose(-1, -2), dy_run).to(compute)
    grad_masked = torch.matmul(dy_run, pieces.u.transpose(-1, -2)).to(compute)  # [b, h, c, l, s]
    grad_scores = (pieces.grouped(grad_masked) * pieces.grouped(decay_mask)).sum(2)  # [b, g, c, l, s]
    grad_scores = grad_scores.masked_fill_(pieces.above_diagonal(), 0.0).to(dtype)
    grad_C = torch.matmul(grad_scores, pieces.B).to(compute)
    grad_B = torch.matmul(grad_scores.transpose(-1, -2), pieces.C).to(compute)
    del grad_scores, decay_mask
    # dM o M is the gradient of each segment sum a_{s+1} + ... + a_l; a_k lies in the segments
    # with s < k <= l, so d a_k = sum_{l >= k} sum_{s < k} (dM o M)[l, s]: partial sums over s,
    # then a masked sum over l (no difference of long sums, which would lose precision).
    before = grad_masked.mul_(masked).cumsum_(-1)[..., :, :-1]  # [l, k-1] = sum_{s < k} (dM o M)[l, s]
    length = pieces.chunk_size
    at_or_after = torch.ones(length, length - 1, dtype=torch.bool, device=dy.device).tril(-1)  # l >= k
    grad_log_decay = F.pad(before.masked_fill_(~at_or_after, 0.0).sum(-2), (1, 0))  # [b, h, c, k]
    return grad_u, grad_B, grad_C, grad_log_decay


class _ChunkedScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dt, A, B, C, initial_state, chunk_size, use_kernels, document_ids, kernel_config):
        pieces = _Pieces(x, dt, A, B, C, chunk_size, document_ids)
        compute = pieces.compute
        batch, heads, head_dim, state_size = pieces.batch, pieces.heads, pieces.head_dim, pieces.state_size

        if use_kernels:  # the chunk states and the recurrence in one pass over the chunks; the
            # entering states stored in the run's dtype, the final one in fp32
            start_states, final_state = _triton_kernels().entering_states(
                pieces.u, pieces.B, pieces.cs, None if initial_state is None else initial_state.to(compute).contiguous())
        else:  # each chunk's state from a zero start, [b, h, c, p, n] fp32
            chunk_states = pieces.chunk_states(pieces.u * pieces.decay_to_end()[..., None].to(pieces.dtype))
            # The state entering each slot z (slot 0 the initial state, slot k+1 chunk k's state):
            # sum_k Decay[z, k] slot_k, without concatenating the slots into one more state-sized copy.
            decay = pieces.chunk_decay_matrix()  # [b, h, c+1, c+1]
            entering = torch.matmul(decay[..., 1:], chunk_states.flatten(-2))  # [b, h, c+1, p*n]
            if initial_state is not None:
                entering += decay[..., :1] * initial_state.to(compute).flatten(-2)[:, :, None]
            entering = entering.view(batch, heads, -1, head_dim, state_size)
            start_states, final_state = entering[:, :, :-1].contiguous(), entering[:, :, -1]

        if use_kernels:  # diagonal and off-diagonal blocks in one kernel, y written once (in x's dtype)
            tile, warps = kernel_config
            y = _triton_kernels().diagonal_forward(pieces.u, pieces.C, pieces.B, pieces.cs, start_states, tile, warps)
        else:
            y = torch.matmul(pieces.masked_scores(pieces.decay_mask()), pieces.u).to(compute)
            y += pieces.read_states(start_states) * pieces.decay_from_start()[..., None]  # off-diagonal blocks
        ctx.save_for_backward(x, dt, A, B, C, start_states, document_ids)
        ctx.chunk_size, ctx.use_kernels, ctx.kernel_config = chunk_size, use_kernels, kernel_config
        natural = _from_per_head_chunks(y, pieces.seq_len)
        if use_kernels:  # the kernel wrote y in x's dtype and layout: no copy (unless the padding is cut off)
            y = natural.contiguous()
        else:  # rounded to x's dtype in the same copy
            y = torch.empty(natural.shape, dtype=x.dtype, device=x.device).copy_(natural)
        # tensors of their own under torch.compile, which on torch 2.11 would otherwise lose their
        # gradients (both are the same objects as tensors computed just before; function_outputs.py)
        return distinct_output(y), distinct_output(final_state.contiguous())

    @staticmethod
    def backward(ctx, grad_y, grad_final):
        x, dt, A, B, C, start_states, document_ids = ctx.saved_tensors
        pieces = _Pieces(x, dt, A, B, C, ctx.chunk_size, document_ids)
        dtype, compute = pieces.dtype, pieces.compute
        if grad_y is None:
            grad_y = x.new_zeros(x.shape)
        # [b, h, c, l, p]: the kernels read dy in the run's dtype (y's), the PyTorch path in fp32
        dy = _per_head_chunks(grad_y, ctx.chunk_size, dtype if ctx.use_kernels else compute)

        if ctx.use_kernels:  # the recurrence walked back, adding the off-diagonal blocks' dH on the way
            grad_chunk_states, grad_chunk_log, grad_initial = _triton_kernels().entering_states_backward(
                dy, pieces.C, pieces.cs, start_states, None if grad_final is None else grad_final.to(compute).contiguous())
        else:
            # Off-diagonal blocks y_off = exp(cs_l) C_l H_c^T: the gradient of the entering states.
            dy_decayed = dy * pieces.decay_from_start()[..., None]
            grad_start = pieces.by_head(torch.einsum("bgjclp,bgcln->bgjcpn", pieces.grouped(dy_decayed),
                                                     pieces.C.to(compute)))
            # The recurrence between chunks: G = Decay^T [dH; d final].
            decay = pieces.chunk_decay_matrix()  # [b, h, c+1, c+1]: rows z = the c chunk starts, then the end
            total = torch.matmul(decay[:, :, :-1].transpose(-1, -2), grad_start.flatten(-2))  # [b, h, c+1, p*n]
            if grad_final is not None:  # the end slot's gradient, without concatenating it to grad_start
                total += decay[:, :, -1, :, None] * grad_final.to(compute).flatten(-2)[:, :, None]
            total = total.view(*grad_start.shape[:2], -1, *grad_start.shape[3:])
            grad_initial, grad_chunk_states = total[:, :, 0], total[:, :, 1:]
            grad_chunk_log = (grad_chunk_states * start_states).sum((-1, -2)) * pieces.chunk_log_decays().exp()
            if pieces.documents is not None:  # no link, no gradient: H_{c+1} = r_c exp(L_c) H_c + st_c
                grad_chunk_log = grad_chunk_log * pieces.documents.slot_continues()

        if ctx.use_kernels:  # diagonal blocks, the off-diagonal parts of dC and d cs, and the chunk
            # states' backward, in two kernels (meshlm/kernels/ssd_diagonal.py); the first also turns
            # du into dx = du dt (in x's dtype and layout) and dt's part sum_p du x, so du is never stored
            tile, warps = ctx.kernel_config
            grad_x, grad_B, grad_C, grad_cs, weight_terms, grad_dt_from_u = _triton_kernels().diagonal_backward(
                pieces.u, pieces.C, pieces.B, pieces.cs, dy, start_states, grad_chunk_states, tile, warps,
                dt=pieces.dt)
            grad_B, grad_C = grad_B.to(compute), grad_C.to(compute)  # summed over each group's heads
            grad_cs = grad_cs.to(compute)
            grad_log_decay = torch.zeros_like(grad_cs)
        else:
            # Diagonal blocks y = M u, M = (C B^T) o L.
            grad_u, grad_B, grad_C, grad_log_decay = _diagonal_backward(pieces, dy)
            grad_cs = torch.zeros_like(pieces.cs)
            # The off-diagonal blocks' parts of dC and d cs.
            grad_C += torch.einsum("bgjclp,bgjcpn->bgcln", pieces.grouped(dy_decayed), pieces.grouped(start_states))
            grad_cs += (dy_decayed * pieces.read_states(start_states)).sum(-1)
            # Chunk states st = (w o u)^T B, w_l = exp(cs_end - cs_l).
            weights = pieces.decay_to_end()
            weighted_u = pieces.u.to(compute) * weights[..., None]
            B_states = pieces.by_head(torch.einsum("bgcln,bgjcpn->bgjclp", pieces.B.to(compute),
                                                   pieces.grouped(grad_chunk_states)))  # B st'^T
            grad_u += B_states * weights[..., None]
            grad_B += torch.einsum("bgjclp,bgjcpn->bgcln", pieces.grouped(weighted_u),
                                   pieces.grouped(grad_chunk_states))
            weight_terms = (weighted_u * B_states).sum(-1)  # dw o w
            grad_cs -= weight_terms
        grad_cs[..., -1] += weight_terms.sum(-1) + grad_chunk_log

        # cs = cumsum(dt A) within each chunk, u = dt x.
        grad_log_decay += grad_cs.flip(-1).cumsum(-1).flip(-1)  # [b, h, c, l]
        if not ctx.use_kernels:  # (the kernels gave dx and sum_p du x already)
            grad_dt_from_u = (grad_u * pieces.x.to(compute)).sum(-1)
            grad_x = grad_u * pieces.dt[..., None]
        grad_dt = grad_log_decay * A.to(compute)[:, None, None] + grad_dt_from_u
        grad_A = (grad_log_decay * pieces.dt).sum((0, 2, 3))

        seq_len = pieces.seq_len
        return (_from_per_head_chunks(grad_x, seq_len).to(x.dtype),
                _from_per_head_chunks(grad_dt, seq_len).to(dt.dtype),
                grad_A.to(A.dtype),
                _from_per_head_chunks(grad_B, seq_len).to(B.dtype),
                _from_per_head_chunks(grad_C, seq_len).to(C.dtype),
                grad_initial if ctx.needs_input_grad[5] else None,
                None, None, None, None)


def ssd_chunked_scan_fast(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                          chunk_size: int, initial_state: torch.Tensor | None = None,
                          use_triton: bool | None = False,
                          document_ids: torch.Tensor | None = None,
                          kernel_config: tuple[int | None, int | None] = (None, None)
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``ssd.ssd_chunked_scan`` with the same arguments and results, computed as the module docstring says.

    x [b, t, heads, head_dim] and B, C [b, t, groups, state] in the run dtype (their matmuls run
    in it); dt [b, t, heads] and A [heads] are used in fp32. Returns y [b, t, heads, head_dim]
    without the D skip, in x's dtype (summed in fp32: module docstring), and the final state
    [b, heads, head_dim, state] in fp32 (fp64 for fp64 x).

    ``use_triton``: compute the diagonal blocks with the Triton kernels of
    ``meshlm/kernels/ssd_diagonal.py`` (True; on CPU tensors they need ``TRITON_INTERPRET=1``), with
    PyTorch (False), or with the kernels where they apply -- CUDA tensors, Triton installed, shapes
    the kernels take -- and PyTorch elsewhere (None). ``document_ids`` [b, t] (packed documents,
    ``ssd.ssd_chunked_scan``): the state restarts at each document; always the PyTorch path.
    ``kernel_config``: the kernels' (tile, warps), each None for the default (tuned on CUDA;
    ``ssd_diagonal.kernel_choices``), fixed by the kernels' self-check (``scan_kernels.py``).
    """
    B, C = B.to(x.dtype), C.to(x.dtype)
    if document_ids is not None:  # the kernels take no document masks (module docstring)
        return _ChunkedScan.apply(x, dt, A, B, C, initial_state, chunk_size, False, document_ids, kernel_config)
    shapes = (chunk_size, x.shape[-1], B.shape[-1], x.dtype)
    if use_triton is None:
        use_triton = x.is_cuda and triton_installed() and _triton_kernels().supported(*shapes)
    elif use_triton and not _triton_kernels().supported(*shapes):
        raise ConfigError(f"the Triton SSD kernels need model.mamba_chunk_size a multiple of "
                          f"{_triton_kernels().BLOCK} (or 16), model.mamba_head_dim and model.mamba_state_size "
                          f"powers of two >= 16 and a float16/bfloat16/float32 run; got chunk {chunk_size}, "
                          f"head dim {x.shape[-1]}, state {B.shape[-1]}, {x.dtype}. Use model.mamba_scan=auto.")
    return _ChunkedScan.apply(x, dt, A, B, C, initial_state, chunk_size, use_triton, None, kernel_config)


__all__ = ["ssd_chunked_scan_fast"]
