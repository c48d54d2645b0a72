"""Dropout whose mask depends only on where an element sits in the run, never on the layout.

Dropout (Srivastava et al. 2014) zeroes each element of an activation with probability p during
training and scales the survivors by 1/(1-p), so the expectation is unchanged. ``nn.Dropout``
draws its mask from a *stateful* generator: the mask an element gets depends on how many numbers
that process drew before it. Split the sequence over tensor-parallel ranks (sequence
parallelism, Korthikanti et al. 2022), over context-parallel ranks, the batch over data-parallel
ranks or the layers over pipeline stages, and every element is drawn by a different generator at
a different offset: the run no longer equals the single-process run, and a parallel run cannot
be checked against one.

Here the mask is *counter-based* (Salmon et al. 2011, "Parallel random numbers: as easy as 1,
2, 3", the idea behind Philox): the random bits of an element are a hash of its global
coordinates,

    bits(e) = H(seed, step, site, sample, position, channel)        a 32-bit integer
    keep(e) = bits(e) >= round(p * 2**32)                            so P(keep) = 1 - p

    seed      train.seed                     step      the optimizer step (restored on resume)
    site      which dropout in the model     sample    the row's index in the global data order
    position  the token's global position    channel   the hidden channel (or head, key position)

so any rank that holds an element computes the same bit for it, whatever else it holds: the
embedding and block-output masks under tp 1 or 4, SP, CP's zigzag chunks (their global
``position_ids``), DP (global sample indices) and PP (stages do not share state) are those of
one process. A recomputed block (activation checkpointing) redraws exactly the same mask, and a
run resumed from a checkpoint continues with the masks of the uninterrupted run.

H folds one coordinate at a time into a running 32-bit state, ``state = mix(state ^ value)``,
where ``mix`` is Wellons' "lowbias32" integer finalizer (two multiply-xorshift rounds found by
his hash prospector, a bijection of [0, 2**32) with near-ideal avalanche). The last coordinate
(channel, or key position) is mixed on its own and xor-ed into the token's state before one
final mix, so the full-size tensor costs a single mix. Everything is plain int64 tensor
arithmetic, on any device: 32-bit multiplications are split into 16-bit halves so no product
leaves int64's range and nothing relies on overflow wrapping. Cost: about 20 elementwise integer
ops per masked element (unfused in eager PyTorch: a reference, not a fast kernel), memory: the
bool mask kept for backward, as ``nn.Dropout``.

Three kinds of dropout use it (``ModelConfig.hidden_dropout`` / ``attention_dropout`` /
``lora_dropout``): ``HiddenDropout`` on [batch, seq, hidden] residual-stream tensors (the embedding
output and each block's mixer output before the residual add: the regions sequence parallelism
shards along the sequence), ``attention_keep_mask`` on the attention probabilities [batch, heads,
query, key] (see ``meshlm.models.attention.attention_with_dropout``), and ``input_keep_mask`` on a
LoRA adapter's input (``meshlm/models/lora.py``), whose tokens a mixer describes with
``TokenCoordinates`` -- a [b, t] tensor, the tokens flattened, or this rank's sequence slice -- and
whose channels the adapter names globally (a row-parallel shard holds some of them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from meshlm.models.position_embedding import sequence_parallel_rows

MASK32 = 0xFFFFFFFF
SITE_KINDS = {"embedding": 0, "block_output": 1, "attention_probs": 2, "lora_input": 16}
"""Dropout site kinds; a site is a kind and a layer index (``dropout_site``). A LoRA adapter's input
is kind 16 + the adapted layer's index in ``model.LORA_TARGETS`` (``lora_dropout_site``), so the
q, k and v adapters of one block draw masks of their own, as PEFT's separate dropouts do."""


# --- the counter-based hash -------------------------------------------------------------------------

def multiply_mod32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2**32 for int64 x in [0, 2**32), exactly: the 16-bit halves of x times a
    32-bit constant stay below 2**49."""
    low, high = x & 0xFFFF, x >> 16
    return (low * constant + (((high * constant) & 0xFFFF) << 16)) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """Wellons' lowbias32: a bijection of [0, 2**32) in which every input bit flips every output
    bit with probability close to 1/2."""
    x = x ^ (x >> 16)
    x = multiply_mod32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = multiply_mod32(x, 0x846CA68B)
    return x ^ (x >> 16)


def fold(state: torch.Tensor, value: torch.Tensor | int) -> torch.Tensor:
    """Fold a coordinate in [0, 2**32) (an int64 tensor, broadcasting, or a Python int) into a
    running hash state."""
    return mix32(state ^ (value & MASK32))


def fold_wide(state: torch.Tensor, value: torch.Tensor | int) -> torch.Tensor:
    """Fold a non-negative coordinate below 2**63 (a seed, a step, a sample index): both halves."""
    return fold(fold(state, value & MASK32), value >> 32)


def drop_threshold(p: float) -> int:
    """Elements whose 32-bit hash lies below this are dropped: P(drop) = p to within 2**-32."""
    return round(p * 2**32)


def dropout_site(kind: str, layer_index: int = 0) -> int:
    """The number naming one dropout in the model: its kind and the global index of its block."""
    if not 0 <= layer_index < 2**24:
        raise ValueError(f"layer index {layer_index} does not fit a dropout site (< 2**24)")
    return (SITE_KINDS[kind] << 24) | layer_index


def lora_dropout_site(layer_index: int, target_index: int) -> int:
    """The dropout site of the input of block ``layer_index``'s adapted layer number ``target_index``
    (its position in ``LORA_TARGETS``)."""
    if not 0 <= target_index < 2**8 - SITE_KINDS["lora_input"]:
        raise ValueError(f"LoRA target index {target_index} does not fit a dropout site")
    return dropout_site("lora_input", layer_index) + (target_index << 24)


# --- which draw a forward is -----------------------------------------------------------------------

@dataclass
class DropoutKey:
    """What fixes a forward's dropout masks besides the coordinates inside the batch.

    The trainer builds it from the run seed, the optimizer step and the micro-batch's global
    sample indices (``Trainer.next_micro_batches``); a forward in training mode outside the
    trainer draws one from torch's generator (``DropoutKey.draw``), like ``nn.Dropout``.
    """

    seed: int
    step: int
    sample_ids: torch.Tensor
    """[batch] non-negative int64: the global index of each row's sample (rows of different DP
    ranks differ)."""

    @staticmethod
    def draw(batch_size: int, device: torch.device | None = None) -> "DropoutKey":
        seed = int(torch.randint(0, 2**62, ()).item())
        return DropoutKey(seed=seed, step=0, sample_ids=torch.arange(batch_size, device=device))

    def row_states(self, site: int, device: torch.device) -> torch.Tensor:
        """[batch] hash states of (seed, step, site, sample) for every row."""
        samples = self.sample_ids.to(device=device, dtype=torch.int64)
        state = torch.zeros((), dtype=torch.int64, device=device)
        state = fold(fold_wide(fold_wide(state, self.seed % 2**63), self.step), site)
        return fold_wide(state.expand_as(samples), samples)


def required_key(context) -> DropoutKey:
    key = getattr(context, "dropout_key", None)
    if key is None:
        raise RuntimeError("dropout in training mode needs SequenceContext.dropout_key (LanguageModel.forward "
                           "draws one when none is given; a pipeline stage gets it from the trainer's micro-batch)")
    return key


# --- masks -------------------------------------------------------------------------------------------

def hidden_keep_mask(key: DropoutKey, site: int, positions: torch.Tensor, width: int, p: float) -> torch.Tensor:
    """[batch, seq, width] bool: keep element (b, t, c) of a residual-stream tensor whose rows
    have global ``positions`` [batch, seq]."""
    rows = key.row_states(site, positions.device)
    tokens = fold(rows[:, None], positions)
    channels = mix32(torch.arange(width, device=positions.device))
    return mix32(tokens[..., None] ^ channels) >= drop_threshold(p)


def attention_keep_mask(key: DropoutKey, site: int, heads: torch.Tensor, query_positions: torch.Tensor,
                        key_positions: torch.Tensor, p: float) -> torch.Tensor:
    """[batch, heads, queries, keys] bool: keep the attention probability of global head
    ``heads[h]``, query at global position ``query_positions[b, i]``, key at ``key_positions[b, j]``."""
    rows = key.row_states(site, heads.device)
    per_head = fold(rows[:, None], heads[None, :])
    per_query = fold(per_head[:, :, None], query_positions[:, None, :])
    keys = mix32(key_positions & MASK32)
    return mix32(per_query[..., None] ^ keys[:, None, None, :]) >= drop_threshold(p)


@dataclass
class TokenCoordinates:
    """Where each token of an activation sits in the run, for masks that do not depend on the layout:
    its row of the batch (an index into ``DropoutKey.sample_ids``) and its global position, both
    shaped like the activation's token dims -- [b, t], or [n] with the tokens flattened."""

    key: DropoutKey
    rows: torch.Tensor
    positions: torch.Tensor

    @staticmethod
    def of(context, parallel_context=None) -> "TokenCoordinates":
        """The tokens of a [b, t, ...] activation of the training forward ``context`` describes (its
        dropout key required): the whole (CP-local) sequence, or with a sequence-parallel
        ``parallel_context`` this rank's slice of it, the rows of the residual stream it holds."""
        key = required_key(context)
        positions = sequence_parallel_rows(context.position_ids, parallel_context)
        rows = torch.arange(positions.shape[0], device=positions.device)[:, None].expand_as(positions)
        return TokenCoordinates(key, rows, positions)

    def flattened(self) -> "TokenCoordinates":
        """The same tokens as a flat [b * t] list (an MoE layer's token order)."""
        return TokenCoordinates(self.key, self.rows.reshape(-1), self.positions.reshape(-1))


FAST_MIX_CONSTANTS = (0x7FEB352D, 0x31848BAB)
"""Odd multipliers below 2**31 for ``input_keep_mask``'s last mix: x * c then stays below 2**63, so
one int64 multiply and a mask give the product mod 2**32 (``multiply_mod32`` takes six ops for
any 32-bit constant)."""


def input_keep_mask(coordinates: TokenCoordinates, site: int, channels: torch.Tensor, p: float) -> torch.Tensor:
    """[..., channels] bool: keep input channel ``channels[c]`` (global indices) of each token of
    ``coordinates`` at dropout ``site``.

    The tokens' states and the channels' hashes are mixed in full (few of them); the element-wise
    step, a LoRA layer's whole input, takes two multiply-xorshift rounds done in place on one int64
    tensor with 31-bit multipliers (``FAST_MIX_CONSTANTS``): about ten passes where ``mix32`` takes
    twenty-odd fresh tensors -- at a 512-wide input of 1024 tokens on this 2-core CPU, 3.1 ms
    rather than 12.7 (a 512 x 512 fp32 GEMM of those tokens: 3.7 ms). Neighbouring channels' and
    tokens' masks stay uncorrelated (|r| < 0.003 there), and four neighbours' parity is that of
    independent draws (0.293 against 0.295)."""
    device = coordinates.positions.device
    rows = coordinates.key.row_states(site, device)[coordinates.rows]
    tokens = fold(rows, coordinates.positions.to(device=device, dtype=torch.int64))
    x = tokens[..., None] ^ mix32(channels.to(device=device, dtype=torch.int64))
    first, second = FAST_MIX_CONSTANTS
    x.bitwise_xor_(x >> 16).mul_(first).bitwise_and_(MASK32)
    x.bitwise_xor_(x >> 15).mul_(second).bitwise_and_(MASK32)
    x.bitwise_xor_(x >> 16)
    return x >= drop_threshold(p)


def apply_keep_mask(x: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    """x where kept, scaled by 1/(1-p); 0 where dropped (backward: the same mask and scale)."""
    return x.masked_fill(~keep, 0) * (1.0 / (1.0 - p))


class HiddenDropout(nn.Module):
    """Dropout on a [batch, seq, hidden] tensor of the residual stream, masked by global coordinates.

    Under sequence parallelism the tensor holds this rank's contiguous 1/tp of the (CP-local)
    sequence: ``parallel_context`` (set by ``meshlm.parallel.parallelize.parallelize_model``)
    says which slice of ``context.position_ids`` its rows are. Active only in training mode.
    """

    parallel_context = None

    def __init__(self, p: float, site: int):
        super().__init__()
        self.p, self.site = p, site

    def extra_repr(self) -> str:
        return f"p={self.p}, site={self.site}"

    def forward(self, x: torch.Tensor, context) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        positions = self.row_positions(context.position_ids, x.shape[1])
        keep = hidden_keep_mask(required_key(context), self.site, positions.expand(x.shape[0], -1), x.shape[-1],
                                self.p)
        return apply_keep_mask(x, keep, self.p)

    def row_positions(self, position_ids: torch.Tensor, length: int) -> torch.Tensor:
        position_ids = sequence_parallel_rows(position_ids, self.parallel_context)
        if position_ids.shape[1] != length:
            raise RuntimeError(f"dropout site {self.site}: the tensor has {length} positions but the context "
                               f"{position_ids.shape[1]} (is a sequence-parallel model missing its parallel_context?)")
        return position_ids


__all__ = ["DropoutKey", "HiddenDropout", "SITE_KINDS", "TokenCoordinates", "apply_keep_mask", "attention_keep_mask",
           "drop_threshold", "dropout_site", "fold", "fold_wide", "hidden_keep_mask", "input_keep_mask",
           "lora_dropout_site", "mix32",
           "multiply_mod32", "required_key"]
