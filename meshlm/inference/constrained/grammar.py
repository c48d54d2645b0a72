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


__all__ = ["Grammar", "MASKS_KEPT"]
