"""Which chunks of the sequence a context-parallel rank holds, and fetching rows of a neighbour's.

Causal attention over contiguous slices is badly balanced (the last slice attends to everything
before it), so the sequence is cut into 2*cp chunks and rank i keeps chunks i and 2cp-1-i
(``paired_chunks``; see ``context_parallel.py`` for the picture). A rank's tokens are its two
chunks concatenated (``local_token_positions``). Layers that hand something along the sequence
(Mamba's convolution window, multi-token prediction's look-ahead) fetch the rows of the chunk
before or after each of theirs from whichever rank holds it (``rows_of_neighbour_chunk``).
"""

from __future__ import annotations

import torch

from meshlm.errors import ConfigError
from meshlm.parallel.collectives import send_and_receive


# --- which chunks a rank holds ---------------------------------------------------------------------

def paired_chunks(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two of the 2*cp sequence chunks rank ``cp_rank`` holds: one from each end."""
    return cp_rank, 2 * cp_size - 1 - cp_rank

def contiguous_chunks(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The naive split (for comparison): rank r holds the r-th contiguous 1/cp of the sequence."""
    return 2 * cp_rank, 2 * cp_rank + 1

CHUNK_LAYOUTS = {"paired": paired_chunks, "contiguous": contiguous_chunks}

def chunk_owner(chunk: int, cp_size: int, layout=paired_chunks) -> tuple[int, int]:
    """(cp rank, local slot 0 or 1) of the rank holding global chunk ``chunk``."""
    for rank in range(cp_size):
        chunks = layout(rank, cp_size)
        if chunk in chunks:
            return rank, chunks.index(chunk)
    raise ValueError(f"chunk {chunk} is not one of the {2 * cp_size} chunks of a CP group of {cp_size}")

def chunk_length(seq_len: int, cp_size: int) -> int:
    if seq_len % (2 * cp_size):
        raise ConfigError(f"a sequence of {seq_len} tokens cannot be cut into 2*cp = {2 * cp_size} equal chunks "
                          f"for context parallelism; use a train.seq_len divisible by {2 * cp_size}.")
    return seq_len // (2 * cp_size)

def local_token_positions(seq_len: int, cp_rank: int, cp_size: int, layout=paired_chunks,
                          device: torch.device | None = None) -> torch.Tensor:
    """Global positions [2 * seq_len / (2 cp)] of the tokens rank ``cp_rank`` holds, in local order."""
    length = chunk_length(seq_len, cp_size)
    starts = [chunk * length for chunk in layout(cp_rank, cp_size)]
    return torch.cat([torch.arange(start, start + length, device=device) for start in starts])

# --- rows of the neighbouring chunk ------------------------------------------------------------------

def rows_of_neighbour_chunk(rows: torch.Tensor, offset: int, context, layout=paired_chunks, fill=0) -> torch.Tensor:
    """For each of this rank's two chunks, the corresponding rows of the chunk ``offset`` (+1: the
    next, -1: the previous) places away in sequence order, fetched from whichever rank holds it;
    ``fill`` where there is no such chunk. ``rows`` [b, 2, w, ...] holds a few rows of each of this
    rank's chunks (e.g. the last w, for a convolution window). One batch of sends and receives; collective
    over the CP group (every rank calls it with the same offset). Not differentiable by itself:
    the adjoint of taking rows from offset -1 is taking their gradient from offset +1 (zeros
    for the last chunk), which ``mamba.py`` uses."""

    rank, size, last = context.cp_rank, context.cp_size, 2 * context.cp_size - 1
    result = torch.full_like(rows, fill)
    sends, receives = [], []
    for slot, chunk in enumerate(layout(rank, size)):
        target, source = chunk - offset, chunk + offset  # whose neighbour I am; who my neighbour is
        if 0 <= target <= last and chunk_owner(target, size, layout)[0] != rank:
            sends.append((rows[:, slot].contiguous(), context.cp_ranks[chunk_owner(target, size, layout)[0]], target))
        if 0 <= source <= last:
            owner, source_slot = chunk_owner(source, size, layout)
            if owner == rank:
                result[:, slot] = rows[:, source_slot]
            else:
                buffer = torch.empty_like(rows[:, slot], memory_format=torch.contiguous_format)
                receives.append((slot, buffer, context.cp_ranks[owner], chunk))
    if sends or receives:
        requests = send_and_receive(sends, [(buffer, peer, tag) for _, buffer, peer, tag in receives], context.cp_group)
        for request in requests:
            request.wait()
    for slot, buffer, _, _ in receives:
        result[:, slot] = buffer
    return result



__all__ = ["CHUNK_LAYOUTS", "chunk_length", "chunk_owner", "contiguous_chunks", "local_token_positions",
           "paired_chunks", "rows_of_neighbour_chunk"]
