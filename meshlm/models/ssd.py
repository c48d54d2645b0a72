"""The SSD scan of Mamba-2: a selective state-space recurrence computed as chunked matmuls.

Mamba-2 (Dao & Gu 2024, "Transformers are SSMs: Generalized Models and Efficient Algorithms
Through Structured State Space Duality") runs, independently for every head h, the recurrence

    h_t = exp(dt_t * A) * h_{t-1}  +  dt_t * x_t B_t^T        h_t: [head_dim P, state N]
    y_t = h_t C_t                                             y_t: [P]

where A < 0 is one scalar per head (the "scalar times identity" structure that makes SSD
possible), and dt_t > 0, B_t, C_t depend on the token (the *selective* part). B and C are
shared by groups of heads, like keys and values in grouped-query attention.

**State-space duality.** Unrolling the recurrence from a zero state gives

    y_t = sum_{s <= t} (C_t . B_s) * exp(a_{s+1} + ... + a_t) * dt_s x_s,     a_k = dt_k A,

i.e. y = (L o C B^T) (dt x): causal "attention" whose scores C_t . B_s are multiplied by a
decay mask L[t, s] = exp(segment sum of a over (s, t]) instead of being softmaxed. The
quadratic (attention) form is matmul-friendly but costs O(T^2); the linear (recurrent) form is
O(T) but sequential. The SSD algorithm splits the sequence into chunks of Q tokens and uses
the quadratic form inside a chunk and the recurrence between chunks -- the matrix L o C B^T is
semiseparable, so its off-diagonal blocks have rank N and factor as C (decay) B^T:

1. **Diagonal blocks (intra-chunk).** Within each chunk, the masked attention above:
   ``scores = C B^T`` [Q x Q per chunk and head], times the decay mask, times dt x.
2. **Chunk states.** The state each chunk would reach from a zero start:
   ``sum_s exp(a_{s+1} + ... + a_end) * dt_s x_s B_s^T`` -- a [P x N] matrix per chunk.
3. **Inter-chunk recurrence.** The true state at the start of every chunk. Instead of a loop
   over chunks, this is one more (small) masked matmul over the chunk axis: start_state[z] =
   sum_{c < z} exp(total decay of chunks c+1 .. z-1) * chunk_state[c] (plus the decayed initial
   state), with the same segment-sum decay matrix, now of size (chunks+1) x (chunks+1).
4. **State to output (off-diagonal blocks).** Each position reads its chunk's start state,
   decayed to that position: ``y_t += exp(a_start + ... + a_t) * start_state C_t``.

Steps 1, 2 and 4 are batched matmuls over all chunks at once; only step 3 couples chunks.
The results are equal to the recurrence for any chunk size, up to rounding.

**Segment sums.** Decays are exponentials of sums of a over a segment (s, t]. Writing a whole
decay matrix as ``exp(cumsum[t] - cumsum[s])`` subtracts two large numbers and loses precision
(and the entries above the diagonal would overflow), so ``segment_sum`` builds each segment sum
by a cumulative sum of a masked copy instead, and puts -inf above the diagonal so that exp()
gives the causal zeros. It builds the decay matrices of steps 1 and 3; steps 2 and 4 only need
decays from a chunk's start or to its end, where a difference of cumulative sums within one
chunk is short and safe.

**Packed documents** (``document_ids`` [b, t], Mamba-2's ``seq_idx``): the state restarts at
each document's first token, as if every document were its own sequence. Since the scan is
linear in its decays, that is the same as setting to zero the decay between any two positions
of different documents, which SSD does with a 0/1 factor in each of the four steps (as the
``seq_idx`` path of ``mamba_ssm``): (1) the intra-chunk decay mask keeps l, s of one document;
(2) a position enters its chunk's state only if it shares the chunk's last token's document;
(3) a state passes from slot k to slot z only if both belong to the same document (slot 0, the
initial state, continues the row's first document; slot z >= 1 belongs to chunk z-1's last
token); (4) a position reads its chunk's start state only if it belongs to that state's document.
The factors are constants, so the same masks give the exact gradients.

Everything here runs in fp32 and is a pure function of its inputs; the D skip connection
(y += D x) is the caller's business.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def segment_sum(values: torch.Tensor, above: float = float("-inf")) -> torch.Tensor:
    """``out[..., i, j] = values[..., j+1] + ... + values[..., i]`` for i >= j, and ``above`` above.

    values [..., T] -> [..., T, T]. With the default -inf, exp(out) is the lower-triangular decay
    matrix of the scan (ones on the diagonal, zeros above it); ``above=0.0`` leaves the empty sums
    above the diagonal as they come out (one pass fewer), for callers that mask elsewhere.
    """
    length = values.shape[-1]
    # repeated[..., k, j] = values[..., k]; keep only terms k > j, then sum down the k axis.
    repeated = values[..., :, None].expand(*values.shape, length)
    strictly_below = torch.ones(length, length, dtype=torch.bool, device=values.device).tril(-1)
    sums = repeated.masked_fill(~strictly_below, 0.0).cumsum(dim=-2)
    if above == 0.0:
        return sums
    causal = torch.ones(length, length, dtype=torch.bool, device=values.device).tril(0)
    return sums.masked_fill(~causal, above)


def expand_groups(tensor: torch.Tensor, num_heads: int, group_dim: int) -> torch.Tensor:
    """Repeat each B/C group for the heads that share it (head h uses group h // (heads/groups))."""
    num_groups = tensor.shape[group_dim]
    if num_heads % num_groups:
        raise ValueError(f"{num_groups} B/C groups do not divide {num_heads} heads")
    return tensor.repeat_interleave(num_heads // num_groups, dim=group_dim)


def split_into_chunks(tensor: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[b, t, ...] -> [b, chunks, chunk_size, ...], zero-padding t up to a multiple of chunk_size.

    Zero padding is harmless: a padded step has dt = 0, so it neither decays the state nor
    adds to it, and its outputs are cut off by the caller.
    """
    pad = -tensor.shape[1] % chunk_size
    if pad:
        tensor = F.pad(tensor, (0, 0) * (tensor.dim() - 2) + (0, pad))
    return tensor.unflatten(1, (-1, chunk_size))


class DocumentMasks:
    """The 0/1 factors of the four SSD steps for packed documents (module docstring), from
    ``document_ids`` [b, t] cut into chunks (the padding of the last chunk continues its document)."""

    def __init__(self, document_ids: torch.Tensor, chunk_size: int):
        pad = -document_ids.shape[1] % chunk_size
        if pad:
            document_ids = torch.cat((document_ids, document_ids[:, -1:].expand(-1, pad)), dim=1)
        self.chunked = document_ids.unflatten(1, (-1, chunk_size))  # [b, c, l]
        # slot 0: the initial state (the row's first document); slot z: after chunk z-1
        self.slots = torch.cat((self.chunked[:, :1, 0], self.chunked[:, :, -1]), dim=1)  # [b, c+1]

    def within_chunk(self) -> torch.Tensor:
        """(1) [b, 1, c, l, s]: l and s in the same document."""
        return (self.chunked[..., :, None] == self.chunked[..., None, :])[:, None]

    def to_chunk_end(self) -> torch.Tensor:
        """(2) [b, 1, c, l]: l in the document of its chunk's last token."""
        return (self.chunked == self.chunked[..., -1:])[:, None]

    def between_slots(self) -> torch.Tensor:
        """(3) [b, 1, z, k]: slots z and k in the same document."""
        return (self.slots[:, :, None] == self.slots[:, None, :])[:, None]

    def from_chunk_start(self) -> torch.Tensor:
        """(4) [b, 1, c, l]: l in the document of the state entering its chunk."""
        return (self.chunked == self.slots[:, :-1, None])[:, None]

    def slot_continues(self) -> torch.Tensor:
        """[b, 1, c]: whether the state after chunk c continues the one before it."""
        return (self.slots[:, 1:] == self.slots[:, :-1])[:, None]


def ssd_chunked_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                     C: torch.Tensor, chunk_size: int,
                     initial_state: torch.Tensor | None = None,
                     document_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the SSM over a whole sequence with the four SSD steps (see the module docstring).

    x [b, t, heads, head_dim]; dt [b, t, heads] (positive, already softplus'ed and clamped);
    A [heads] (negative); B, C [b, t, groups, state]; initial_state [b, heads, head_dim, state]
    or None (zeros). Returns y [b, t, heads, head_dim] without the D skip, and the state after
    the last token [b, heads, head_dim, state], both fp32. ``document_ids`` [b, t] (packed
    documents): the state restarts at every document's first token; the initial state continues
    the first document, and the final state is that of the last.

    Index letters in the einsums: b batch, c/z chunk, l/s position in a chunk (target/source),
    h head, p head channel, n state channel.
    """
    batch, seq_len, num_heads, head_dim = x.shape
    state_size = B.shape[-1]
    dt = dt.float()
    B = expand_groups(B.float(), num_heads, group_dim=2)
    C = expand_groups(C.float(), num_heads, group_dim=2)
    x_dt = x.float() * dt[..., None]  # the input term dt_s x_s of the discretized recurrence
    log_decay = A.float() * dt  # a_t = dt_t A <= 0

    # [b, c, l, ...] layout; log decays as [b, h, c, l] so cumulative sums run along the chunk.
    x_dt, B, C, log_decay = (split_into_chunks(tensor, chunk_size) for tensor in (x_dt, B, C, log_decay))
    log_decay = log_decay.permute(0, 3, 1, 2)
    decay_cumsum = log_decay.cumsum(dim=-1)  # [b, h, c, l]: sum of a from chunk start to l

    documents = None if document_ids is None else DocumentMasks(document_ids, chunk_size)

    # 1. Diagonal blocks: masked attention inside each chunk (two [Q x Q] batched matmuls).
    decay_mask = torch.exp(segment_sum(log_decay))  # [b, h, c, l, s]
    if documents is not None:
        decay_mask = decay_mask * documents.within_chunk()
    scores = torch.einsum("bclhn,bcshn->bhcls", C, B)
    y_diag = torch.einsum("bhcls,bcshp->bclhp", scores * decay_mask, x_dt)

    # 2. Chunk states: each chunk's inputs decayed to the chunk's end, summed into [P x N].
    decay_to_chunk_end = torch.exp(decay_cumsum[..., -1:] - decay_cumsum)  # [b, h, c, l]
    if documents is not None:
        decay_to_chunk_end = decay_to_chunk_end * documents.to_chunk_end()
    B_decayed = B * decay_to_chunk_end.permute(0, 2, 3, 1)[..., None]
    chunk_states = torch.einsum("bclhn,bclhp->bchpn", B_decayed, x_dt)

    # 3. Inter-chunk recurrence as a matmul with the chunk-level decay matrix. Slot 0 holds the
    #    initial state; start_states[z] is the state entering chunk z, the last one the final state.
    if initial_state is None:
        initial_state = torch.zeros(batch, num_heads, head_dim, state_size, device=x.device)
    states = torch.cat((initial_state.float()[:, None], chunk_states), dim=1)  # [b, c+1, h, p, n]
    chunk_log_decay = F.pad(decay_cumsum[..., -1], (1, 0))  # [b, h, c+1]: total decay per chunk
    chunk_decay = torch.exp(segment_sum(chunk_log_decay))  # [b, h, z, c]
    if documents is not None:
        chunk_decay = chunk_decay * documents.between_slots()
    start_states = torch.einsum("bhzc,bchpn->bzhpn", chunk_decay, states)
    start_states, final_state = start_states[:, :-1], start_states[:, -1]

    # 4. State to output: read each chunk's start state with C, decayed to the position.
    decay_from_chunk_start = torch.exp(decay_cumsum)
    if documents is not None:
        decay_from_chunk_start = decay_from_chunk_start * documents.from_chunk_start()
    decay_from_chunk_start = decay_from_chunk_start.permute(0, 2, 3, 1)[..., None]  # [b, c, l, h, 1]
    y_off = torch.einsum("bclhn,bchpn->bclhp", C, start_states) * decay_from_chunk_start

    y = (y_diag + y_off).flatten(1, 2)[:, :seq_len]
    return y, final_state


def ssd_recurrent_step(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                       B: torch.Tensor, C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Advance the SSM by one token: ``h = exp(dt A) h + dt x B^T``, ``y = h C``.

    state [b, heads, head_dim, state]; x [b, heads, head_dim]; dt [b, heads]; A [heads];
    B, C [b, groups, state]. Returns y [b, heads, head_dim] (no D skip) and the new state, fp32.
    """
    num_heads = x.shape[1]
    dt = dt.float()
    B = expand_groups(B.float(), num_heads, group_dim=1)
    C = expand_groups(C.float(), num_heads, group_dim=1)
    decay = torch.exp(dt * A.float())[..., None, None]  # [b, h, 1, 1]
    new_state = decay * state.float() + torch.einsum("bhp,bhn->bhpn", x.float() * dt[..., None], B)
    y = torch.einsum("bhpn,bhn->bhp", new_state, C)
    return y, new_state


__all__ = ["DocumentMasks", "ssd_chunked_scan", "ssd_recurrent_step", "segment_sum", "expand_groups", "split_into_chunks"]
