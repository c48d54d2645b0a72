"""Per-layer state kept between forward calls during generation.

An attention block keeps the keys and values of every token seen so far (the KV cache); a
Mamba-2 block keeps only a fixed-size state -- the last ``conv_kernel - 1`` inputs of its
causal convolution and the SSM state [heads, head_dim, state_size] -- which is why a hybrid
model's memory per generated token stays flat where a Transformer's grows.

States are created by the blocks themselves on first use (``state_for``), keyed by block index,
so the cache needs to know nothing about the model.

**Sliding windows.** A sliding-window attention block (``model.sliding_window`` W) never reads a
key more than W - 1 tokens back, so its cache keeps only the last W - 1 keys (plus what a
rollback may undo) and drops older ones when its buffers run out of room: the kept keys move to
the front, about once every W tokens, and the buffers stay about twice the window whatever the
context (``AttentionCache.make_room``). Gemma 3's five sliding layers of six then hold a window's
keys, not the context's (``bench/sliding_window.py``'s generation figures). The dropped keys'
slots are counted (``AttentionCache.start``), so the padding mask, kept for all tokens, still
lines up with the keys held.

**Rolling back.** Speculative decoding (``meshlm/inference/speculative.py``) feeds the model
draft tokens and then has to forget the rejected ones: ``InferenceCache.truncate`` undoes the
latest tokens. For attention that is a count (the keys past it are overwritten later). A Mamba
state cannot be run backwards, so after ``enable_rollback(n)`` each Mamba cache keeps what it
needs to undo up to n tokens: its SSM state before and after each of the latest n tokens, and
n more columns of conv inputs (``MambaCache``). Until then generation keeps nothing extra.

**Joining and trimming batches.** A server that batches requests as they come
(``meshlm/inference/continuous_batching.py``) adds sequences to a batch that is already decoding:
``InferenceCache.join`` appends another cache's sequences as rows, both right-aligned on their
latest token -- the shorter side is left-padded, as a prompt shorter than its batch's longest is,
so the rows decode exactly as they would alone. Sequences leave when they finish (``select``), and
the columns before every remaining row's first real token then hold padding only:
``drop_leading_padding`` cuts them off, so the cache stays as long as its longest live sequence,
not as long as the server has been running.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


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


def tensor_bytes(*tensors: torch.Tensor | None) -> int:
    """Bytes of the distinct tensors given (None and repeats of one tensor are skipped)."""
    distinct = {id(tensor): tensor for tensor in tensors if tensor is not None}
    return sum(tensor.numel() * tensor.element_size() for tensor in distinct.values())


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
    window: int | None = None
    """The block's sliding window (``model.sliding_window``), None for full attention: keys more
    than ``keep`` tokens back are dropped when room is needed (``make_room``)."""
    rollback_window: int = 0
    """How many of the latest tokens ``forget_latest`` may undo once keys have been dropped
    (speculative decoding; ``InferenceCache.enable_rollback``): a windowed cache keeps that many more."""
    start: int = 0
    """Slot, among all tokens seen, of the first key held: how many were dropped (0 without a window)."""

    @property
    def keep(self) -> int | None:
        """How many of the latest keys a sliding-window cache must hold between forwards: the
        window's W - 1 before the next token, and the rollback window's on top; None without a window."""
        return None if self.window is None else self.window - 1 + self.rollback_window

    def make_room(self, incoming: int) -> None:
        """Before ``incoming`` tokens are written into a sliding-window cache: when its buffers lack
        room for them, or hold more than a window of slack beyond ``2 keep + incoming`` (a long
        prompt's, at the first decoding step), the keys older than the last ``keep`` are dropped and
        the rest moved to the front -- into buffers of exactly 2 keep + incoming when they are
        resized. Decoding then drops keys once every keep + 1 tokens, in place, and never
        reallocates."""
        if self.window is None or self.key_buffer is None:
            return
        keep, capacity = self.keep, self.key_buffer.shape[2]
        target = 2 * keep + incoming
        oversized = capacity > target + keep
        if self.length + incoming <= capacity and not oversized:
            return
        drop = max(self.length - keep, 0)
        held = self.length - drop
        size = target if oversized or held + incoming > capacity else capacity
        for name in ("key_buffer", "value_buffer"):
            buffer = getattr(self, name)
            kept = buffer[:, :, drop:self.length]
            if size != capacity:
                resized = buffer.new_zeros(*buffer.shape[:2], size, buffer.shape[3])
                resized[:, :, :held] = kept
                setattr(self, name, resized)
            elif drop:
                buffer[:, :, :held] = kept.clone()  # the two ranges may overlap
        self.start += drop
        self.length = held

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self.key_buffer is None else self.key_buffer[:, :, :self.length]

    @property
    def values(self) -> torch.Tensor | None:
        return None if self.value_buffer is None else self.value_buffer[:, :, :self.length]

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new tokens' keys and values after the held ones; returns all of them (views)."""
        self.make_room(keys.shape[2])
        needed = self.length + keys.shape[2]
        self.key_buffer = grown(self.key_buffer, keys, 2, self.length, needed, self.capacity_hint)
        self.value_buffer = grown(self.value_buffer, values, 2, self.length, needed, self.capacity_hint)
        self.key_buffer[:, :, self.length:needed] = keys
        self.value_buffer[:, :, self.length:needed] = values
        self.length = needed
        return self.keys, self.values

    def reserve(self, num_tokens: int) -> int:
        """Count ``num_tokens`` more tokens as held, growing the buffers if they lack room, and
        return where they start: the caller writes their keys and values there itself (the compiled
        decode step does, ``meshlm/inference/decode_step.py``). Only after a first ``append``."""
        self.make_room(num_tokens)
        start, needed = self.length, self.length + num_tokens
        self.key_buffer = grown(self.key_buffer, self.key_buffer, 2, start, needed, self.capacity_hint)
        self.value_buffer = grown(self.value_buffer, self.value_buffer, 2, start, needed, self.capacity_hint)
        self.length = needed
        return start

    def forget_latest(self, num_tokens: int) -> None:
        """Drop the last ``num_tokens`` tokens: only the count shrinks, the next append overwrites them.
        A sliding-window cache that has dropped keys can undo at most its rollback window."""
        if not 0 <= num_tokens <= self.length:
            raise ValueError(f"cannot forget {num_tokens} of the {self.length} cached tokens")
        if self.start and num_tokens > self.rollback_window:
            raise RuntimeError(f"this sliding-window cache can undo at most {self.rollback_window} tokens (its "
                               f"rollback window), not {num_tokens}: older keys are gone")
        self.length -= num_tokens

    def select(self, batch_indices: torch.Tensor) -> None:
        if self.key_buffer is not None:
            self.key_buffer, self.value_buffer = self.key_buffer[batch_indices], self.value_buffer[batch_indices]

    def joined(self, other: AttentionCache, seen: int, other_seen: int, total: int,
               capacity: int | None) -> AttentionCache:
        """This cache's sequences and then ``other``'s in one cache whose slots run to ``total``, each
        side's latest key in slot ``total - 1`` (``seen`` and ``other_seen``: the tokens each side
        has seen); slots a side never held are zeros (its padding mask is False there, or, under a
        sliding window, they are older than the window). ``capacity``: slots to allocate at least."""
        starts = (self.start + total - seen, other.start + total - other_seen)
        start = min(starts)
        length = total - start
        key_shape = (self.key_buffer.shape[0] + other.key_buffer.shape[0], *self.key_buffer.shape[1:2],
                     max(length, capacity or 0), self.key_buffer.shape[3])
        merged = AttentionCache(capacity_hint=self.capacity_hint, window=self.window, start=start, length=length,
                                rollback_window=max(self.rollback_window, other.rollback_window))
        for name in ("key_buffer", "value_buffer"):
            buffer = getattr(self, name).new_zeros(key_shape)
            rows = 0
            for side, side_start in ((self, starts[0]), (other, starts[1])):
                held = getattr(side, name)[:, :, :side.length]
                first = side_start - start
                buffer[rows:rows + held.shape[0], :, first:first + side.length] = held
                rows += held.shape[0]
            setattr(merged, name, buffer)
        return merged

    def drop_slots(self, count: int) -> None:
        """Forget the first ``count`` slots of every sequence (padding everywhere: ``InferenceCache.
        drop_leading_padding``); the slots after them are numbered from 0."""
        dropped_keys = max(count - self.start, 0)
        self.start = max(self.start - count, 0)
        if dropped_keys and self.key_buffer is not None:
            self.length -= dropped_keys
            self.key_buffer = self.key_buffer[:, :, dropped_keys:].clone()
            self.value_buffer = self.value_buffer[:, :, dropped_keys:].clone()

    @property
    def nbytes(self) -> int:
        """Bytes allocated (capacity, not only the tokens held)."""
        return tensor_bytes(self.key_buffer, self.value_buffer)


@dataclass
class MambaCache:
    """The recurrent state of one Mamba-2 block.

    With a rollback window of n tokens (``enable_rollback``) it can also undo its latest tokens,
    up to n of them: the SSM state after each of those tokens is kept (the Mamba mixer then
    steps through the last n tokens of each forward one recurrent step at a time, see
    ``Mamba2Mixer.scan``), and the conv window holds n more columns of past inputs, from which
    the window as it was n tokens ago is a slice."""

    conv_state: torch.Tensor | None = None
    """[batch, conv_channels, conv_kernel - 1 + rollback_window]: the most recent inputs of the
    causal conv, newest last (the conv reads the last conv_kernel - 1)."""
    ssm_state: torch.Tensor | None = None
    """[batch, heads, head_dim, state_size], fp32."""
    rollback_window: int = 0
    """How many of the latest tokens ``forget_latest`` may undo; 0 (the default): none."""
    recent_ssm_states: list[torch.Tensor] = field(default_factory=list)
    """With a rollback window: the SSM states before and after each of the latest (up to
    rollback_window) tokens, oldest first; the last one is ``ssm_state``."""

    def enable_rollback(self, num_tokens: int) -> None:
        """Keep what undoing up to ``num_tokens`` latest tokens needs, from the next forward on.

        The conv window is widened on the left with zeros: they stand for inputs older than any
        token that can be undone (only tokens seen from now on can), so they are never read."""
        if num_tokens <= self.rollback_window:
            return
        if self.conv_state is None:
            raise RuntimeError("a Mamba cache can roll back only tokens after its first forward")
        if self.rollback_window == 0:
            self.recent_ssm_states = [self.ssm_state]
        self.conv_state = F.pad(self.conv_state, (num_tokens - self.rollback_window, 0))
        self.rollback_window = num_tokens

    def remember_states(self, states: list[torch.Tensor], start: torch.Tensor | None = None) -> None:
        """Keep the SSM ``states`` after each of the latest tokens, oldest first. ``start`` is the
        state before them when tokens that were not stepped one by one came in between (those
        cannot be undone); None when they follow the states already kept."""
        history = self.recent_ssm_states if start is None else [start]
        self.recent_ssm_states = (history + states)[-(self.rollback_window + 1):]

    def forget_latest(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` tokens: back to the SSM state kept before them, and the conv
        window shifted back by as many columns (zeros enter on the left, never read; see
        ``enable_rollback``)."""
        if num_tokens == 0:
            return
        if not 0 < num_tokens < len(self.recent_ssm_states):
            raise RuntimeError(f"this Mamba cache can undo at most {max(len(self.recent_ssm_states) - 1, 0)} "
                               f"tokens (rollback window {self.rollback_window}), not {num_tokens}")
        del self.recent_ssm_states[-num_tokens:]
        self.ssm_state = self.recent_ssm_states[-1]
        self.conv_state = F.pad(self.conv_state[:, :, :-num_tokens], (num_tokens, 0))

    def select(self, batch_indices: torch.Tensor) -> None:
        if self.conv_state is not None:
            self.conv_state = self.conv_state[batch_indices]
        self.recent_ssm_states = [state[batch_indices] for state in self.recent_ssm_states]
        if self.recent_ssm_states:
            self.ssm_state = self.recent_ssm_states[-1]
        elif self.ssm_state is not None:
            self.ssm_state = self.ssm_state[batch_indices]

    def joined(self, other: MambaCache) -> MambaCache:
        """This cache's sequences and then ``other``'s: a recurrent state has no length, so the rows
        only stack (caches that can roll back are not joined)."""
        if self.rollback_window or other.rollback_window:
            raise RuntimeError("Mamba caches that can roll back tokens (speculative decoding) cannot be joined")
        return MambaCache(conv_state=torch.cat([self.conv_state, other.conv_state]),
                          ssm_state=torch.cat([self.ssm_state, other.ssm_state]))

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.conv_state, self.ssm_state, *self.recent_ssm_states)


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
        self.rollback_window = 0
        """The largest ``enable_rollback`` so far (given to attention states made later too)."""
        self.has_padding = False
        """Whether a token seen so far was padding. While it is False attention needs no key mask,
        and knowing it costs no look over the whole mask (and no device sync) per decode step."""

    @property
    def token_mask(self) -> torch.Tensor | None:
        """[batch, tokens seen] bool, False on padding."""
        return None if self.mask_buffer is None else self.mask_buffer[:, :self.num_seen_tokens]

    def state_for(self, layer_index: int, state_type: type, window: int | None = None):
        """Block ``layer_index``'s state, made on first use; an attention block gives its sliding
        ``window`` (None: full attention)."""
        state = self.layers.get(layer_index)
        if state is None:
            state = self.layers[layer_index] = state_type()
            if isinstance(state, AttentionCache):
                state.window, state.rollback_window = window, self.rollback_window
                state.capacity_hint = self.max_tokens
                if window is not None and self.max_tokens is not None:
                    state.capacity_hint = min(self.max_tokens, 2 * window)
        return state

    def append_token_mask(self, token_mask: torch.Tensor | None, batch: int, seq: int,
                          device: torch.device) -> torch.Tensor:
        """Record the new tokens' mask (None: all real); returns their positions [batch, seq]: 0, 1,
        2, ... counting only real tokens of each sequence so far (padding takes its neighbour's
        position), in work independent of the tokens already seen."""
        if token_mask is None:
            token_mask = torch.ones(batch, seq, dtype=torch.bool, device=device)
        else:
            token_mask = token_mask.bool()
            self.has_padding = self.has_padding or not bool(token_mask.all())
        needed = self.num_seen_tokens + seq
        self.mask_buffer = grown(self.mask_buffer, token_mask, 1, self.num_seen_tokens, needed, self.max_tokens)
        self.mask_buffer[:, self.num_seen_tokens:needed] = token_mask
        self.num_seen_tokens = needed
        seen_before = self.real_tokens if self.real_tokens is not None else torch.zeros(batch, dtype=torch.long,
                                                                                        device=device)
        counts = seen_before[:, None] + token_mask.long().cumsum(-1)
        self.real_tokens = counts[:, -1]
        return (counts - 1).clamp(min=0)

    def enable_rollback(self, num_tokens: int) -> None:
        """Let ``truncate`` undo up to ``num_tokens`` of the latest tokens, from the next forward on
        (for the Mamba blocks that exist now: call it after a first forward)."""
        self.rollback_window = max(self.rollback_window, num_tokens)
        for state in self.layers.values():
            if isinstance(state, MambaCache):
                state.enable_rollback(num_tokens)
            else:
                state.rollback_window = max(state.rollback_window, num_tokens)

    def truncate(self, num_tokens: int) -> None:
        """Forget every token after the first ``num_tokens`` seen (rejected draft tokens), as if the
        cache had never seen them. Mamba blocks can undo only up to their rollback window."""
        dropped = self.num_seen_tokens - num_tokens
        if dropped < 0:
            raise ValueError(f"cannot truncate a cache of {self.num_seen_tokens} tokens to {num_tokens}")
        if dropped == 0:
            return
        self.real_tokens = self.real_tokens - self.mask_buffer[:, num_tokens:self.num_seen_tokens].sum(-1)
        self.num_seen_tokens = num_tokens
        for state in self.layers.values():
            state.forget_latest(dropped)

    def select(self, batch_indices: torch.Tensor) -> None:
        """Keep only some sequences of the batch (e.g. drop finished ones)."""
        for state in self.layers.values():
            state.select(batch_indices)
        if self.mask_buffer is not None:
            self.mask_buffer = self.mask_buffer[batch_indices]
            self.real_tokens = self.real_tokens[batch_indices]

    @property
    def batch_size(self) -> int:
        return 0 if self.mask_buffer is None else self.mask_buffer.shape[0]

    def join(self, other: InferenceCache, capacity: int | None = None) -> None:
        """Append ``other``'s sequences to this cache's batch, as rows after its own (module
        docstring): both sides right-aligned on their latest token, the shorter left-padded, so that
        every row's next token attends to and continues from exactly what it did before. Both must
        come from the same model, with every block's state made (a forward seen). ``capacity``:
        token slots to allocate at least (the longest the joined sequences may grow to)."""
        if set(self.layers) != set(other.layers) or self.mask_buffer is None or other.mask_buffer is None:
            raise ValueError("only caches of the same model that have both seen a forward can be joined")
        seen, other_seen = self.num_seen_tokens, other.num_seen_tokens
        total = max(seen, other_seen)
        mask = self.mask_buffer.new_zeros(self.batch_size + other.batch_size, max(total, capacity or 0))
        mask[:self.batch_size, total - seen:total] = self.token_mask
        mask[self.batch_size:, total - other_seen:total] = other.token_mask
        for index, state in self.layers.items():
            other_state = other.layers[index]
            if type(state) is not type(other_state):
                raise ValueError(f"block {index} holds different kinds of state in the two caches")
            self.layers[index] = (state.joined(other_state, seen, other_seen, total, capacity)
                                  if isinstance(state, AttentionCache) else state.joined(other_state))
        self.mask_buffer, self.num_seen_tokens = mask, total
        self.real_tokens = torch.cat([self.real_tokens, other.real_tokens])
        self.has_padding = self.has_padding or other.has_padding or seen != other_seen
        self.rollback_window = max(self.rollback_window, other.rollback_window)
        self.max_tokens = None if self.max_tokens is None or other.max_tokens is None else max(
            self.max_tokens, other.max_tokens)

    def drop_leading_padding(self) -> int:
        """Cut off the columns before the first real token of any sequence (padding in every row,
        left behind by sequences that have left the batch); returns how many. Looks at the whole
        mask once: call it when the batch changes, not every step."""
        if self.mask_buffer is None or not self.num_seen_tokens:
            return 0
        real_columns = self.token_mask.any(0).nonzero()
        count = int(real_columns[0]) if len(real_columns) else self.num_seen_tokens
        if count == 0:
            return 0
        self.mask_buffer = self.mask_buffer[:, count:].clone()
        self.num_seen_tokens -= count
        self.has_padding = not bool(self.token_mask.all())
        for state in self.layers.values():
            if isinstance(state, AttentionCache):
                state.drop_slots(count)
        return count

    @property
    def nbytes(self) -> int:
        """Bytes held by every block's state (KV capacity, Mamba conv and SSM states)."""
        return sum(state.nbytes for state in self.layers.values())
