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


@dataclass
class AttentionCache:
    """Keys and values [batch, kv_heads, tokens, head_dim] of all tokens seen so far."""

    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = torch.cat((self.keys, keys), dim=2)
            self.values = torch.cat((self.values, values), dim=2)
        return self.keys, self.values

    def select(self, batch_indices: torch.Tensor) -> None:
        if self.keys is not None:
            self.keys, self.values = self.keys[batch_indices], self.values[batch_indices]


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
    """All blocks' states plus the padding mask of every token seen so far."""

    def __init__(self) -> None:
        self.layers: dict[int, AttentionCache | MambaCache] = {}
        self.token_mask: torch.Tensor | None = None

    @property
    def num_seen_tokens(self) -> int:
        return 0 if self.token_mask is None else self.token_mask.shape[1]

    def state_for(self, layer_index: int, state_type: type):
        state = self.layers.get(layer_index)
        if state is None:
            state = self.layers[layer_index] = state_type()
        return state

    def append_token_mask(self, token_mask: torch.Tensor | None, batch: int, seq: int,
                          device: torch.device) -> None:
        if token_mask is None:
            token_mask = torch.ones(batch, seq, dtype=torch.bool, device=device)
        token_mask = token_mask.bool()
        self.token_mask = token_mask if self.token_mask is None else torch.cat((self.token_mask, token_mask), 1)

    def select(self, batch_indices: torch.Tensor) -> None:
        """Keep only some sequences of the batch (e.g. drop finished ones)."""
        for state in self.layers.values():
            state.select(batch_indices)
        if self.token_mask is not None:
            self.token_mask = self.token_mask[batch_indices]
