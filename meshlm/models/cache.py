"""Per-layer state kept between forward calls during generation.

An attention block keeps the keys and values of every token seen so far (the KV cache); a
Mamba-2 block keeps only a fixed-size state -- the last ``conv_kernel - 1`` inputs of its
causal convolution and the SSM state [heads, head_dim, state_size] -- which is why a hybrid
model's memory per generated token stays flat where a Transformer's grows.

States are created by the blocks themselves on first use (``state_for``), keyed by block index,
so the cache needs to know nothing about the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def grown(buffer: torch.Tensor | None, like: torch.Tensor, dim: int, length: int, needed: int,
          hint: int | None) -> torch.Tensor:
    """A buffer shaped like ``like`` with at least ``needed`` entries along ``dim``, holding the
    first ``length`` entries of ``buffer``: ``buffer`` itself when it is big enough, else a new
    one of max(needed, twice the old capacity, ``hint``) -- so n appends copy O(n) elements in all."""
    capacity = 0 if buffer is None else buffer.shape[dim]
    if needed <= capacity:
        return buffer
    shape = list(like.shape)
    shape[dim] = max(needed, 2 * capacity, hint or 0)
    larger = like.new_zeros(shape)
    if length:
        larger.narrow(dim, 0, length).copy_(buffer.narrow(dim, 0, length))
    return larger


@dataclass
class AttentionCache:
    """Keys and values [batch, kv_heads, tokens, head_dim] of all tokens seen so far.

    They live in preallocated buffers: a new token is written in place, never concatenated
    (which would copy the whole cache every token). The capacity is ``capacity_hint`` tokens at
    the first append (``InferenceCache(max_tokens)``: the prompt plus the tokens to generate)
    and doubles whenever it runs out."""

    key_buffer: torch.Tensor | None = None
    value_buffer: torch.Tensor | None = None
    length: int = 0
    """Tokens held (the buffers may have room for more)."""
    capacity_hint: int | None = None

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self.key_buffer is None else self.key_buffer[:, :, :self.length]

    @property
    def values(self) -> torch.Tensor | None:
        return None if self.value_buffer is None else self.value_buffer[:, :, :self.length]

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new tokens' keys and values after the held ones; returns all of them (views)."""
        needed = self.length + keys.shape[2]
        self.key_buffer = grown(self.key_buffer, keys, 2, self.length, needed, self.capacity_hint)
        self.value_buffer = grown(self.value_buffer, values, 2, self.length, needed, self.capacity_hint)
        self.key_buffer[:, :, self.length:needed] = keys
        self.value_buffer[:, :, self.length:needed] = values
        self.length = needed
        return self.keys, self.values

    def select(self, batch_indices: torch.Tensor) -> None:
        if self.key_buffer is not None:
            self.key_buffer, self.value_buffer = self.key_buffer[batch_indices], self.value_buffer[batch_indices]

    @property
    def nbytes(self) -> int:
        """Bytes allocated (capacity, not only the tokens held)."""
        return sum(buffer.numel() * buffer.element_size() for buffer in (self.key_buffer, self.value_buffer)
                   if buffer is not None)


@dataclass
class MambaCache:
    """The recurrent state of one Mamba-2 block."""

    conv_state: torch.Tensor | None = None
    """[batch, conv_channels, conv_kernel - 1]: the most recent inputs of the causal conv."""
    ssm_state: torch.Tensor | None = None
    """[batch, heads, head_dim, state_size], fp32."""

    def select(self, batch_indices: torch.Tensor) -> None:
        if self.conv_state is not None:
            self.conv_state = self.conv_state[batch_indices]
        if self.ssm_state is not None:
            self.ssm_state = self.ssm_state[batch_indices]


class InferenceCache:
    """All blocks' states plus the padding mask of every token seen so far.

    ``max_tokens``: the most tokens a sequence will reach (prompt + new tokens), if known: the
    KV and mask buffers are allocated at that size once instead of growing by doubling."""

    def __init__(self, max_tokens: int | None = None) -> None:
        self.layers: dict[int, AttentionCache | MambaCache] = {}
        self.max_tokens = max_tokens
        self.mask_buffer: torch.Tensor | None = None
        self.num_seen_tokens = 0
        self.real_tokens: torch.Tensor | None = None
        """[batch] int64: unmasked tokens seen per sequence (the next token's position)."""

    @property
    def token_mask(self) -> torch.Tensor | None:
        """[batch, tokens seen] bool, False on padding."""
        return None if self.mask_buffer is None else self.mask_buffer[:, :self.num_seen_tokens]

    def state_for(self, layer_index: int, state_type: type):
        state = self.layers.get(layer_index)
        if state is None:
            state = self.layers[layer_index] = state_type()
            if isinstance(state, AttentionCache):
                state.capacity_hint = self.max_tokens
        return state

    def append_token_mask(self, token_mask: torch.Tensor | None, batch: int, seq: int,
                          device: torch.device) -> torch.Tensor:
        """Record the new tokens' mask; returns their positions [batch, seq]: 0, 1, 2, ... counting
        only real tokens of each sequence so far (padding takes its neighbour's position), in
        work independent of the tokens already seen."""
        if token_mask is None:
            token_mask = torch.ones(batch, seq, dtype=torch.bool, device=device)
        token_mask = token_mask.bool()
        needed = self.num_seen_tokens + seq
        self.mask_buffer = grown(self.mask_buffer, token_mask, 1, self.num_seen_tokens, needed, self.max_tokens)
        self.mask_buffer[:, self.num_seen_tokens:needed] = token_mask
        self.num_seen_tokens = needed
        seen_before = self.real_tokens if self.real_tokens is not None else torch.zeros(batch, dtype=torch.long,
                                                                                        device=device)
        counts = seen_before[:, None] + token_mask.long().cumsum(-1)
        self.real_tokens = counts[:, -1]
        return (counts - 1).clamp(min=0)

    def select(self, batch_indices: torch.Tensor) -> None:
        """Keep only some sequences of the batch (e.g. drop finished ones)."""
        for state in self.layers.values():
            state.select(batch_indices)
        if self.mask_buffer is not None:
            self.mask_buffer = self.mask_buffer[batch_indices]
            self.real_tokens = self.real_tokens[batch_indices]

    @property
    def nbytes(self) -> int:
        """Bytes held by every block's state (KV capacity, Mamba conv and SSM states)."""
        total = 0
        for state in self.layers.values():
            if isinstance(state, AttentionCache):
                total += state.nbytes
            else:
                total += sum(tensor.numel() * tensor.element_size()
                             for tensor in (state.conv_state, state.ssm_state) if tensor is not None)
        return total
