"""Context parallelism (CP): every sequence is split over the CP group, balanced for causal work.

Long sequences make activations, not weights, the memory problem: attention's and Mamba's
activations grow with the sequence length, and tensor/sequence parallelism can only cut them
by tp. Context parallelism splits the *sequence* itself over cp ranks: each rank embeds, norms,
projects and feeds forward only its own tokens, and the two layers that mix tokens exchange what
they need -- attention passes keys and values around a ring (``ring_attention.py``, Liu et al.
2023, "Ring Attention with Blockwise Transformers"), Mamba-2 hands its convolution window and
SSM state over in sequence order (``mamba.py``). Every rank holds the whole (TP-shard of the)
model, so dense gradients are summed over DP and CP together (the ``dp_cp`` group).

**Chunk pairing.** Cut the sequence into cp contiguous slices and causal attention is badly
balanced: the last slice attends to everything before it, the first to almost nothing (rank
cp-1 does 2cp-1 times the work of rank 0). Instead the sequence is cut into 2*cp chunks and
rank i keeps chunks i and 2cp-1-i -- one from the cheap front, one from the expensive back
(Megatron-LM's context parallelism; Dubey et al. 2024, "The Llama 3 herd of models", §3.3.2).
Every rank then does exactly the same causal work (``bench/context_parallel_balance.py``;
the chunk layout is ``chunks.py``):

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
the dp_cp gradient reduction (and the logging) adds them over CP. Multi-token prediction's
terms are shared the same way (its depth-k inputs and labels come k tokens later, across chunk
boundaries: ``ContextParallelShift``). The other terms are per-token means over equal token
counts, so their share is 1/cp of the rank's value. The MoE layer's terms (Switch balance loss,
z-loss) and its capacity dropping depend on the routing of the whole micro-batch, not of one
rank's chunks; under CP the MoE blocks therefore always run as the expert-grid layer
(``meshlm/parallel/expert/expert_parallel.py``, even at ep = 1), which all-gathers the routing over CP, so each rank's
1/cp share of those terms adds up to the single-process value and drops what one process drops.

With cp = 1 every function here is the identity, so the trainer calls them unconditionally.
"""

from __future__ import annotations

import torch

from meshlm.errors import ConfigError
from meshlm.models.attention import SelfAttention
from meshlm.models.context import positions_in_documents
from meshlm.models.losses import IGNORE_INDEX
from meshlm.models.mamba2 import Mamba2Mixer
from meshlm.models.mtp import shift_left
from meshlm.parallel.context.chunks import local_token_positions, paired_chunks, rows_of_neighbour_chunk
from meshlm.parallel.context.mamba import make_context_parallel_mamba
from meshlm.parallel.context.ring_attention import RingAttentionCore



class ContextParallelShift:
    """``shift_left`` (meshlm/models/mtp.py) for a CP rank's tokens: position t gets the token
    ``steps`` later in the whole sequence, the last ones of a chunk coming from the next chunk's
    first tokens (multi-token prediction's future inputs and labels)."""

    def __init__(self, context, layout=paired_chunks):
        self.context, self.layout = context, layout

    def __call__(self, tensor: torch.Tensor, steps: int, fill: int) -> torch.Tensor:
        batch, length = tensor.shape[:2]
        chunks = tensor.view(batch, 2, length // 2, *tensor.shape[2:])
        if steps > chunks.shape[2]:
            raise ConfigError(f"multi-token prediction looks {steps} tokens ahead, more than a context-parallel "
                              f"chunk of {chunks.shape[2]}; use a longer train.seq_len or a smaller parallel.cp.")
        following = rows_of_neighbour_chunk(chunks[:, :, :steps], +1, self.context, self.layout, fill)
        return torch.cat((chunks[:, :, steps:], following), dim=2).view_as(tensor)


# --- slicing a micro-batch -----------------------------------------------------------------------

def slice_sequence(tensor: torch.Tensor, context, dim: int = 1) -> torch.Tensor:
    """This CP rank's tokens of a full-sequence tensor (its two chunks, concatenated along dim)."""
    if context.cp_size == 1:
        return tensor
    positions = local_token_positions(tensor.shape[dim], context.cp_rank, context.cp_size, device=tensor.device)
    return tensor.index_select(dim, positions)


def split_batch(batch: dict[str, torch.Tensor], context) -> dict[str, torch.Tensor]:
    """A micro-batch as this CP rank runs it: its chunks of ``input_ids`` and ``labels``, the
    global ``position_ids`` of those tokens, and the whole sequences' labels (``sequence_labels``,
    for the loss shares of ``share_losses``). With packed documents also this rank's
    ``document_ids``, their ``document_positions`` (counted on the whole row) and the whole rows'
    ``sequence_document_ids``. Identity at cp = 1."""
    if context.cp_size == 1:
        return batch
    input_ids, labels = batch["input_ids"], batch["labels"]
    positions = local_token_positions(input_ids.shape[1], context.cp_rank, context.cp_size,
                                      device=input_ids.device)
    local = {**batch, "input_ids": input_ids.index_select(1, positions), "labels": labels.index_select(1, positions),
             "position_ids": positions.expand(input_ids.shape[0], -1), "sequence_labels": labels}
    if "document_ids" in batch:  # packed documents: positions inside them counted on the whole row
        document_ids = batch["document_ids"]
        local.update(document_ids=document_ids.index_select(1, positions), sequence_document_ids=document_ids,
                     document_positions=positions_in_documents(document_ids).index_select(1, positions))
    return local


def target_share(sequence_labels: torch.Tensor, steps_ahead: int, context,
                 sequence_document_ids: torch.Tensor | None = None) -> float:
    """The fraction of the whole sequences' labelled targets ``steps_ahead`` tokens further on
    (0: the next-token labels; k: multi-token prediction depth k) that sit at this rank's positions.
    With packed documents, a target in another document is none (multi-token prediction skips it)."""
    targets = shift_left(sequence_labels, steps_ahead, fill=IGNORE_INDEX) if steps_ahead else sequence_labels
    labelled = targets != IGNORE_INDEX
    if steps_ahead and sequence_document_ids is not None:
        labelled &= shift_left(sequence_document_ids, steps_ahead, fill=0) == sequence_document_ids
    return float(slice_sequence(labelled, context).sum()) / max(int(labelled.sum()), 1)


def share_losses(output, batch: dict[str, torch.Tensor], context, mtp_loss_coeff: float | None = None):
    """Turn a model output computed on this rank's chunks into this rank's share of the losses.

    The model reports means over its own tokens. A cross-entropy term becomes mean * (own
    labelled targets / the whole sequences' labelled targets) = own loss sum / all labelled
    targets: 'lm' with the next-token labels, 'mtp_k' with the labels k tokens further on (the
    last k tokens of a sequence have none, so the ranks' counts differ), 'mtp' the mean of those
    shares over depths. Every other term (the MoE terms, which every CP rank computes from the
    routing of the whole micro-batch) becomes 1/cp of its value. ``output.loss`` (rebuilt from the shares, with
    ``mtp_loss_coeff`` = ``model.mtp_loss_coeff``) and ``output.losses`` are replaced in place;
    summed over the CP group the shares give the micro-batch's losses. Identity at cp = 1.
    """
    if context.cp_size == 1:
        return output
    uniform, losses = 1.0 / context.cp_size, output.losses
    depths = sorted(int(name[4:]) for name in losses if name.startswith("mtp_"))
    weights = {"lm": target_share(batch["sequence_labels"], 0, context)}
    weights.update({f"mtp_{k}": target_share(batch["sequence_labels"], k, context, batch.get("sequence_document_ids"))
                    for k in depths})
    shares = {name: value * weights.get(name, uniform) for name, value in losses.items()}
    loss = output.loss * uniform + (shares["lm"] - losses["lm"] * uniform)  # the rest is uniform
    if depths:
        if mtp_loss_coeff is None:
            raise ValueError("share_losses of a model with multi-token prediction needs mtp_loss_coeff "
                             "(model.mtp_loss_coeff) to rebuild the total loss from the shares.")
        shares["mtp"] = torch.stack([shares[f"mtp_{k}"] for k in depths]).mean()
        loss = loss + mtp_loss_coeff * (shares["mtp"] - losses["mtp"] * uniform)
    output.loss, output.losses = loss, shares
    return output


# --- the model ---------------------------------------------------------------------------------------

def check_context_parallel_model(model_config, cp_size: int, seq_len: int | None = None) -> None:
    """Refuse, before any collective, chunks shorter than what is fetched from a neighbouring
    chunk: the Mamba conv window (K - 1 tokens) and multi-token prediction's look-ahead; and
    attention dropout, which ring attention does not implement."""
    attends = "*" in model_config.block_kinds or (model_config.mtp_depth and "*" in model_config.mtp_pattern)
    if cp_size > 1 and model_config.attention_dropout > 0 and attends:
        raise ConfigError(f"model.attention_dropout={model_config.attention_dropout} is not supported under context "
                          f"parallelism (parallel.cp={cp_size}: ring attention has no dropout); set "
                          "model.attention_dropout=0 or parallel.cp=1 (model.hidden_dropout works at any layout).")
    if cp_size == 1 or seq_len is None:
        return
    chunk = seq_len // (2 * cp_size)
    window = model_config.mamba_conv_kernel - 1 if "M" in model_config.block_kinds else 0
    for needed, what in ((window, f"the Mamba conv window of {window} (model.mamba_conv_kernel - 1)"),
                         (model_config.mtp_depth, f"the multi-token prediction look-ahead of "
                                                  f"model.mtp_depth={model_config.mtp_depth}")):
        if chunk < needed:
            raise ConfigError(f"train.seq_len={seq_len} gives context-parallel chunks of {chunk} tokens (2*cp = "
                              f"{2 * cp_size} chunks), shorter than {what}; use a longer train.seq_len or a "
                              "smaller parallel.cp.")


def apply_context_parallel(model, context):
    """Make ``model`` (single-process or tensor-parallel) run on this CP rank's chunks, in place:
    attention cores become ring attention over the CP group, Mamba-2 mixers hand their conv
    window and SSM state over (see ``mamba.py``), multi-token prediction shifts its inputs and
    labels across chunks. Everything else needs nothing: it acts per token. Returns the model;
    with cp = 1 it is unchanged."""
    if context.cp_size == 1:
        return model
    for module in model.modules():
        if isinstance(module, SelfAttention):
            module.core = RingAttentionCore(context)
        elif isinstance(module, Mamba2Mixer):
            make_context_parallel_mamba(module, context)
    if getattr(model, "mtp", None) is not None:
        model.mtp.shift = ContextParallelShift(context)
    return model


__all__ = ["ContextParallelShift", "apply_context_parallel", "check_context_parallel_model", "share_losses",
           "slice_sequence", "split_batch", "target_share"]
