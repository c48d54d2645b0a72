"""A grammar over one vocabulary: its recognizer, and the token mask of every state met so far.

The masks are what constrained decoding spends its time on (``vocabulary.py``'s walk), and a
reply's states repeat -- every character of a long string value is the same state, and requests
with the same schema meet the same states -- so a ``Grammar`` remembers them, the least recently
used dropped past ``MASKS_KEPT``. One ``Grammar`` serves every request with the same schema
(``meshlm serve`` keeps them by schema); requests build their constraints on their own threads
while the batcher's thread draws, so every use goes through one lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from meshlm.inference.constrained.json_recognizer import JsonRecognizer, State
from meshlm.inference.constrained.json_schema import Node
from meshlm.inference.constrained.vocabulary import Vocabulary

MASKS_KEPT = 4096
"""Masks remembered per grammar (the least recently used are dropped beyond)."""


class Grammar:
    """The recognizer of ``node`` over ``vocabulary``, with the masks of the states met so far."""

    def __init__(self, node: Node, vocabulary: Vocabulary):
        self.recognizer, self.vocabulary = JsonRecognizer(node), vocabulary
        self.lock = threading.Lock()
        self._masks: OrderedDict[State, torch.Tensor] = OrderedDict()
        self._device_masks: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self._goes_on: dict[State, bool] = {}

    @property
    def initial(self) -> State:
        return self.recognizer.initial

    def feed(self, state: State, data: bytes) -> State | None:
        """The state after the bytes ``data`` (None: refused)."""
        with self.lock:
            return self.recognizer.feed(state, data)

    def complete(self, state: State) -> bool:
        with self.lock:
            return self.recognizer.complete(state)

    def mask(self, state: State) -> torch.Tensor:
        """[vocabulary size] bool on the CPU: the text tokens allowed from ``state`` (do not modify it)."""
        with self.lock:
            mask = self._masks.get(state)
            if mask is not None:
                self._masks.move_to_end(state)
                return mask
            mask = torch.zeros(self.vocabulary.size, dtype=torch.bool)
            ids = self.vocabulary.allowed_ids(self.recognizer, state)
            if ids:
                mask[torch.tensor(ids)] = True
            self._masks[state] = mask
            if len(self._masks) > MASKS_KEPT:
                self._masks.popitem(last=False)
            return mask

    def can_go_on(self, state: State) -> bool:
        """Whether any text token is allowed from ``state`` (kept per state)."""
        known = self._goes_on.get(state)
        if known is None:
            known = self._goes_on[state] = bool(self.mask(state).any())
        return known

    def refused_mask(self, state: State, end_ids: tuple[int, ...], width: int, device) -> torch.Tensor:
        """[width] bool on ``device``: the tokens *not* allowed from ``state`` -- ``end_ids`` allowed where
        the document is complete -- over a logits row ``width`` wide (ids past the vocabulary: refused).
        Kept per (state, ends, width, device), so a decoding step copies no mask to the device."""
        ends = end_ids if end_ids and self.complete(state) else ()
        key = (state, ends, width, str(device))
        with self.lock:
            mask = self._device_masks.get(key)
            if mask is not None:
                self._device_masks.move_to_end(key)
                return mask
        allowed = self.mask(state)
        row = torch.zeros(width, dtype=torch.bool)
        row[:min(width, allowed.shape[0])] = allowed[:width]
        if ends:
            row[list(ends)] = True
        mask = (~row).to(device)
        with self.lock:
            self._device_masks[key] = mask
            if len(self._device_masks) > MASKS_KEPT:
                self._device_masks.popitem(last=False)
        return mask




GRAMMARS_KEPT = 64
"""Grammars a ``GrammarCache`` keeps (the least recently used are dropped beyond)."""


class GrammarCache:
    """The grammars of one tokenizer's vocabulary by the schema they were read from, so requests with
    the same schema share their masks (``meshlm serve`` keeps one). The vocabulary trie is built on
    first use: ``size`` ids of ``tokenizer`` (the ones the model draws from)."""

    def __init__(self, tokenizer, size: int):
        self.tokenizer, self.size = tokenizer, size
        self.lock = threading.Lock()
        self._vocabulary: Vocabulary | None = None
        self._grammars: OrderedDict[str, Grammar] = OrderedDict()

    @property
    def vocabulary(self) -> Vocabulary:
        with self.lock:
            if self._vocabulary is None:
                spelt = self.tokenizer.text_tokens()[:self.size]
                self._vocabulary = Vocabulary(spelt + [None] * (self.size - len(spelt)))
            return self._vocabulary

    def grammar(self, key: str, node: Node) -> Grammar:
        """The grammar kept under ``key`` (the canonical text of what ``node`` was read from), or a new
        one of ``node``."""
        vocabulary = self.vocabulary
        with self.lock:
            grammar = self._grammars.get(key)
            if grammar is None:
                grammar = self._grammars[key] = Grammar(node, vocabulary)
                if len(self._grammars) > GRAMMARS_KEPT:
                    self._grammars.popitem(last=False)
            self._grammars.move_to_end(key)
            return grammar


__all__ = ["GRAMMARS_KEPT", "Grammar", "GrammarCache", "MASKS_KEPT"]
