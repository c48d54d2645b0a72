"""Mamba-2 under context parallelism: exact results with each rank holding two chunks of the sequence.

Two parts of the Mamba-2 mixer (``meshlm/models/mamba2.py``) look back along the sequence; the
rest (projections, dt, D skip, gated norm) acts per token and runs unchanged on a rank's chunks.

**The causal convolution** of K taps needs, at the start of each chunk, the last K-1 conv inputs
of the chunk before it in sequence order. Each rank sends the tails of its chunks to the ranks
holding the following chunks (batched isend/irecv; under the chunk pairing, to its two ring
neighbours) and convolves each chunk continuing from the window it received -- zeros for the
first chunk of the sequence, as the single-process conv's padding. The backward sends the
window's gradient back to where the window came from.

**The SSM** h_t = exp(a_t) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t (see ``meshlm/models/ssd.py``) is linear in
the state, so a chunk's output splits into the part from its own inputs (a scan from a zero state)
and the part from the state it starts in, h0, decayed to each position:

    y_t = y_t|zero start + exp(a_1 + ... + a_t) * h0 C_t                (t counted from the chunk start)

We chose this *parallel* exact method over a serial relay (rank after rank, each waiting for the
previous chunk's final state, which would idle all but one rank and visit the ranks twice per
layer under the pairing). Every rank scans its two chunks from zero at the same time, producing
each chunk's final state S_c (the state it would end in from a zero start) and total log-decay
L_c = sum of a over the chunk. One all-gather over the CP group shares these [heads, P, N] + [heads]
summaries; each rank then runs the tiny scan over the 2*cp chunks in sequence order,

    h0_0 = 0,    h0_{c+1} = exp(L_c) h0_c + S_c,

to get the true start states of its own chunks, and adds their contribution above -- the same
decomposition SSD itself uses between its internal chunks (its steps 3 and 4). The all-gather's
adjoint (a reduce-scatter) returns each rank's gradient of the summaries to their owner, so the
backward is autograd's. The result equals the single-process mixer up to fp32 summation order.

Under tensor parallelism each rank holds its own heads and B/C groups and does the same on them;
under sequence parallelism ``in_proj`` has gathered the CP-local sequence, so nothing changes.

**Packed documents** (``data.document_boundaries``): the state must not cross a document
boundary, here either. Everything needed is local, from each token's position inside its document
(computed on the whole row before the batch was cut into chunks, so it counts tokens on other
ranks too): the conv masks its taps by it (``causal_conv``); each chunk is scanned from zero with
its document ids; a state passes *through* chunk c -- h0_{c+1} = exp(L_c) h0_c + S_c -- only if
no document starts inside it, i.e. its last token's document began before the chunk (position >=
chunk length; otherwise L_c is sent as -inf, so exp(L_c) = 0); and token t (t from the chunk's
start) reads the start state h0 only if its document began before the chunk (position > t).
"""

from __future__ import annotations

import torch

from meshlm.errors import ConfigError
from meshlm.models.causal_conv import causal_conv_silu
from meshlm.models.mamba2 import Mamba2Mixer
from meshlm.models.ssd import expand_groups, ssd_chunked_scan
from meshlm.parallel.collectives import all_gather_along
from meshlm.parallel.context.chunks import chunk_owner, paired_chunks, rows_of_neighbour_chunk


# --- the conv window handed over between chunks ---------------------------------------------------

class _PreviousWindows(torch.autograd.Function):
    """tails [b, 2, w, ch] of this rank's chunks -> windows [b, 2, w, ch]: for each chunk, the tail
    of the chunk before it in sequence order (zeros before the first chunk)."""

    @staticmethod
    def forward(ctx, tails, context, layout):
        ctx.context, ctx.layout = context, layout
        return rows_of_neighbour_chunk(tails, -1, context, layout)

    @staticmethod
    def backward(ctx, grad_windows):
        """The adjoint: a tail's gradient is that of the window of the chunk after it (none for the last)."""
        return rows_of_neighbour_chunk(grad_windows, +1, ctx.context, ctx.layout), None, None


def previous_windows(chunks: torch.Tensor, width: int, context, layout=paired_chunks) -> torch.Tensor:
    """For this rank's chunks [b, 2, c, channels], the last ``width`` rows of the chunk before
    each in sequence order (zeros before the first chunk) [b, 2, width, channels]; differentiable."""
    if width > chunks.shape[2]:
        raise ConfigError(f"a context-parallel chunk of {chunks.shape[2]} tokens is shorter than the Mamba conv "
                          f"window of {width} (model.mamba_conv_kernel - 1); use a longer train.seq_len or a "
                          "smaller parallel.cp.")
    return _PreviousWindows.apply(chunks[:, :, chunks.shape[2] - width:].contiguous(), context, layout)


def context_parallel_conv(xBC: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, context,
                          layout=paired_chunks, document_positions: torch.Tensor | None = None) -> torch.Tensor:
    """silu(depthwise causal conv) of this rank's two chunks xBC [b, 2c, ch], each continuing from
    the window of the chunk before it; equal to the single-process conv at these positions.
    ``document_positions`` [b, 2c]: positions inside packed documents (the window restarts at each)."""
    batch, length, channels = xBC.shape
    chunks = xBC.view(batch, 2, length // 2, channels)
    windows = previous_windows(chunks, weight.shape[-1] - 1, context, layout)  # [b, 2, K-1, ch]
    if document_positions is not None:
        document_positions = document_positions.reshape(batch * 2, length // 2)
    out = causal_conv_silu(chunks.flatten(0, 1), weight, bias, windows.flatten(0, 1),
                           document_positions=document_positions)  # [2b, c, ch]
    return out.view(batch, length, channels)


# --- the SSM state handed over between chunks -----------------------------------------------------------

def start_states(final_states: torch.Tensor, log_decays: torch.Tensor, context, layout=paired_chunks) -> torch.Tensor:
    """The true SSM state entering each of this rank's chunks [b, 2, h, p, n], from every chunk's
    zero-start final state S [b, 2, h, p, n] and total log-decay L [b, 2, h] (all-gathered over the
    CP group, then h0_0 = 0, h0_{c+1} = exp(L_c) h0_c + S_c in sequence order)."""
    batch, _, heads, head_dim, state_size = final_states.shape
    summaries = torch.cat((final_states.flatten(-2), log_decays.unsqueeze(-1)), dim=-1)  # [b, 2, h, p*n + 1]
    gathered = all_gather_along(summaries.unsqueeze(0), dim=0, group=context.cp_group)  # [cp, b, 2, h, p*n + 1]
    mine = layout(context.cp_rank, context.cp_size)
    state = final_states.new_zeros(batch, heads, head_dim, state_size)
    entering = {}
    for chunk in range(max(mine) + 1):
        entering[chunk] = state
        owner, slot = chunk_owner(chunk, context.cp_size, layout)
        summary = gathered[owner, :, slot]
        chunk_state, chunk_log_decay = summary[..., :-1].view_as(state), summary[..., -1]
        state = torch.exp(chunk_log_decay)[..., None, None] * state + chunk_state
    return torch.stack([entering[chunk] for chunk in mine], dim=1)


def context_parallel_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                          chunk_size: int, context, layout=paired_chunks, chunked_scan=ssd_chunked_scan,
                          document_ids: torch.Tensor | None = None,
                          document_positions: torch.Tensor | None = None) -> torch.Tensor:
    """The SSM over this rank's two chunks (x [b, 2c, h, p], dt [b, 2c, h], B, C [b, 2c, g, n]),
    exact: each chunk scanned from zero by ``chunked_scan`` (the mixer's), then corrected by its
    true start state (module docstring). Returns y [b, 2c, h, p] fp32 without the D skip. Packed
    documents: ``document_ids`` and ``document_positions`` [b, 2c] of these tokens (both or neither)."""
    batch, length, heads, head_dim = x.shape
    as_chunks = lambda tensor: tensor.reshape(batch * 2, length // 2, *tensor.shape[2:])  # noqa: E731
    documents = {} if document_ids is None else {"document_ids": as_chunks(document_ids)}
    y, final_states = chunked_scan(as_chunks(x), as_chunks(dt), A, as_chunks(B), as_chunks(C), chunk_size,
                                   **documents)
    log_decay = (dt.float() * A.float()).view(batch, 2, length // 2, heads)  # a_t = dt_t A
    decay_cumsum = log_decay.cumsum(dim=2)  # a_1 + ... + a_t from each chunk's start
    from_start_decay = torch.exp(decay_cumsum)
    chunk_log_decays = decay_cumsum[:, :, -1]
    if document_positions is not None:  # (module docstring) no state through or into another document
        positions = document_positions.view(batch, 2, length // 2)
        begun_before = positions > torch.arange(length // 2, device=positions.device)  # [b, 2, c]
        chunk_log_decays = chunk_log_decays.masked_fill(~begun_before[:, :, -1:], float("-inf"))
        from_start_decay = from_start_decay * begun_before[..., None]
    entering = start_states(final_states.view(batch, 2, heads, head_dim, -1), chunk_log_decays, context, layout)
    C_heads = expand_groups(C.float(), heads, group_dim=2).view(batch, 2, length // 2, heads, -1)
    from_start = torch.einsum("bzthn,bzhpn->bzthp", C_heads, entering) * from_start_decay.unsqueeze(-1)
    return y.reshape(batch, length, heads, head_dim) + from_start.reshape(batch, length, heads, head_dim)


# --- the mixer ----------------------------------------------------------------------------------------------

class ContextParallelMamba2Mixer(Mamba2Mixer):
    """``Mamba2Mixer`` on this rank's two chunks: the conv and the scan continue across chunks."""

    cp_context = None
    chunk_layout = staticmethod(paired_chunks)

    def conv_from_start(self, xBC: torch.Tensor, document_positions: torch.Tensor | None = None) -> torch.Tensor:
        return context_parallel_conv(xBC, self.conv1d.weight, self.conv1d.bias, self.cp_context, self.chunk_layout,
                                     document_positions)

    def scan(self, x, dt, B, C, state, document_ids=None, document_positions=None) -> torch.Tensor:
        if state is not None:
            raise ValueError("context parallelism runs training forwards only: no Mamba cache (generate with a "
                             "single-process or tensor-parallel model).")
        A = -torch.exp(self.A_log.float())
        return context_parallel_scan(x, dt, A, B, C, self.chunk_size, self.cp_context, self.chunk_layout,
                                     self.chunked_scan, document_ids, document_positions)


def make_context_parallel_mamba(mixer: Mamba2Mixer, context, layout=paired_chunks) -> None:
    """Turn a (single-process or tensor-parallel) Mamba-2 mixer into its CP version, in place."""
    mixer.__class__ = ContextParallelMamba2Mixer
    mixer.cp_context = context
    mixer.chunk_layout = layout


__all__ = ["ContextParallelMamba2Mixer", "context_parallel_conv", "context_parallel_scan",
           "make_context_parallel_mamba",
           "previous_windows", "start_states"]
