"""Context parallelism (CP): every sequence is split over the CP group, balanced for causal work.

Long sequences make activations, not weights, the memory problem: attention's and Mamba's
activations grow with the sequence length, and tensor/sequence parallelism can only cut them
by tp. Context parallelism splits the *sequence* itself over cp ranks: each rank embeds, norms,
projects and feeds forward only its own tokens, and the two layers that mix tokens exchange what
they need -- attention passes keys and values around a ring (``ring_attention.py``, Liu et al.
2023, "Ring Attention with Blockwise Transformers"), Mamba-2 hands its convolution window and
SSM state over in sequence order (``cp_mamba.py``). Every rank holds the whole (TP-shard of the)
model, so dense gradients are summed over DP and CP together (the ``dp_cp`` group).

**Chunk pairing.** Cut the sequence into cp contiguous slices and causal attention is badly
balanced: the last slice attends to everything before it, the first to almost nothing (rank
cp-1 does 2cp-1 times the work of rank 0). Instead the sequence is cut into 2*cp chunks and
rank i keeps chunks i and 2cp-1-i -- one from the cheap front, one from the expensive back
(Megatron-LM's context parallelism; Dubey et al. 2024, "The Llama 3 herd of models", §3.3.2).
Every rank then does exactly the same causal work (``bench/context_parallel_balance.py``):

    cp = 2, 8 tokens, chunks of 2:   |t0 t1|t2 t3|t4 t5|t6 t7|
                                       ch0   ch1   ch2   ch3
    rank 0: ch0 + ch3 = t0 t1 t6 t7       rank 1: ch1 + ch2 = t2 t3 t4 t5

A rank's tokens are its two chunks concatenated (``local_token_positions``); the global
positions go with them into RoPE (``position_ids``), so rotary phases are the single-process
ones, and every layer that does not mix tokens runs unchanged on the shortened sequence.

**Data and loss** (``split_batch``, ``share_losses``). Every rank of a CP group reads the same
micro-batches and keeps its chunks. The loss must stay the single-process mean over all tokens
of the micro-batch, so each rank's language-model loss is its share -- the sum of its tokens'
losses over the labelled tokens of the *whole* sequences -- and the shares sum to the mean when
the dp_cp gradient reduction (and the logging) adds them over CP. The other loss terms are
per-token means over equal token counts, so their share is 1/cp of the rank's value. The MoE
router's Switch load-balancing loss multiplies two per-token means (traffic fraction times mean
probability); per CP rank it is computed over that rank's tokens, so under CP the aux term is
the mean over CP ranks of per-rank balance losses -- balance at the granularity of a chunk pair
instead of the micro-batch (the language-model loss and the z-loss are exact).

With cp = 1 every function here is the identity, so the trainer calls them unconditionally.
"""

from __future__ import annotations

import torch

from meshlm.models.config import ConfigError
from meshlm.models.losses import IGNORE_INDEX


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


# --- slicing a micro-batch -----------------------------------------------------------------------

def slice_sequence(tensor: torch.Tensor, context, dim: int = 1) -> torch.Tensor:
    """This CP rank's tokens of a full-sequence tensor (its two chunks, concatenated along dim)."""
    if context.cp_size == 1:
        return tensor
    positions = local_token_positions(tensor.shape[dim], context.cp_rank, context.cp_size, device=tensor.device)
    return tensor.index_select(dim, positions)


def split_batch(batch: dict[str, torch.Tensor], context) -> dict[str, torch.Tensor]:
    """A micro-batch as this CP rank runs it: its chunks of ``input_ids`` and ``labels``, the
    global ``position_ids`` of those tokens, and ``lm_loss_weight`` -- the fraction of the whole
    sequences' labelled tokens that are this rank's (see ``share_losses``). Identity at cp = 1."""
    if context.cp_size == 1:
        return batch
    input_ids, labels = batch["input_ids"], batch["labels"]
    positions = local_token_positions(input_ids.shape[1], context.cp_rank, context.cp_size,
                                      device=input_ids.device)
    local_labels = labels.index_select(1, positions)
    labelled = int((labels != IGNORE_INDEX).sum())
    return {**batch, "input_ids": input_ids.index_select(1, positions), "labels": local_labels,
            "position_ids": positions.expand(input_ids.shape[0], -1),
            "lm_loss_weight": float((local_labels != IGNORE_INDEX).sum()) / max(labelled, 1)}


def share_losses(output, batch: dict[str, torch.Tensor], context):
    """Turn a model output computed on this rank's chunks into this rank's share of the losses.

    The model reports means over its own tokens. The language-model term becomes
    mean * (own labelled tokens / whole sequences' labelled tokens) = own loss sum / all labelled
    tokens; every other term (MoE aux and z losses: means over equal token counts) becomes 1/cp
    of its value. ``output.loss`` and ``output.losses`` are replaced in place; summed over the
    CP group the shares give the micro-batch's losses. Identity at cp = 1.
    """
    if context.cp_size == 1:
        return output
    uniform = 1.0 / context.cp_size
    lm = output.losses["lm"]
    output.loss = output.loss * uniform + lm * (batch["lm_loss_weight"] - uniform)
    output.losses = {name: value * (batch["lm_loss_weight"] if name == "lm" else uniform)
                     for name, value in output.losses.items()}
    return output


# --- the model ---------------------------------------------------------------------------------------

def check_context_parallel_model(model_config, cp_size: int, seq_len: int | None = None) -> None:
    """Refuse what context parallelism does not support, before any collective: multi-token
    prediction, and chunks shorter than the Mamba conv window (the window comes from one chunk)."""
    if cp_size == 1:
        return
    if model_config.mtp_depth:
        raise ConfigError(f"model.mtp_depth={model_config.mtp_depth} with parallel.cp={cp_size}: multi-token "
                          "prediction shifts tokens across chunk boundaries, which context parallelism does not "
                          "do yet; set model.mtp_depth=0 or parallel.cp=1.")
    window = model_config.mamba_conv_kernel - 1
    if seq_len is not None and "M" in model_config.block_kinds and seq_len // (2 * cp_size) < window:
        raise ConfigError(f"train.seq_len={seq_len} gives context-parallel chunks of {seq_len // (2 * cp_size)} "
                          f"tokens (2*cp = {2 * cp_size} chunks), shorter than the Mamba conv window of {window} "
                          "(model.mamba_conv_kernel - 1); use a longer train.seq_len or a smaller parallel.cp.")


def apply_context_parallel(model, context):
    """Make ``model`` (single-process or tensor-parallel) run on this CP rank's chunks, in place:
    attention cores become ring attention over the CP group, Mamba-2 mixers hand their conv
    window and SSM state over (see ``cp_mamba.py``). Everything else needs nothing: it acts per
    token. Returns the model; with cp = 1 it is unchanged."""
    if context.cp_size == 1:
        return model
    from meshlm.models.attention import SelfAttention
    from meshlm.models.mamba2 import Mamba2Mixer
    from meshlm.parallel.cp_mamba import make_context_parallel_mamba
    from meshlm.parallel.ring_attention import RingAttentionCore

    check_context_parallel_model(model.config, context.cp_size)
    for module in model.modules():
        if isinstance(module, SelfAttention):
            module.core = RingAttentionCore(context)
        elif isinstance(module, Mamba2Mixer):
            make_context_parallel_mamba(module, context)
    return model


__all__ = ["CHUNK_LAYOUTS", "apply_context_parallel", "check_context_parallel_model", "chunk_length", "chunk_owner",
           "contiguous_chunks", "local_token_positions", "paired_chunks", "share_losses", "slice_sequence",
           "split_batch"]
