"""One reply held to a grammar: the tokens it may draw next, and its state as it draws them.

Before each token the decoding loop sets the logits of every token the grammar does not allow to
-inf (``mask_logits``), draws as usual (greedy or sampled, after the same temperature, top-k/p
and penalties), and hands the drawn token back (``advance``). The ids that end a reply (end of
turn, eos) are allowed exactly when the text so far is a whole document; a document that can
go no further (``{...}`` closed) and has no end id to draw ends the reply by itself
(``finished``). Replies are thus always well-formed unless they run out of ``max_tokens``.

A constraint may start part way into its grammar (``prefix``): a forced tool call whose opening
the prompt already holds continues from there.

Grammars are shared: a ``Grammar`` (``grammar.py``) keeps what every reply with the same schema
learns (the recognizer's steps, the masks of its states).
"""

from __future__ import annotations

from typing import Protocol

import torch

from meshlm.errors import ConfigError
from meshlm.inference.constrained.grammar import Grammar
from meshlm.inference.constrained.json_recognizer import State


class DecodingConstraint(Protocol):
    """What decoding asks of a constraint (``TokenConstraint``, and the partial ones of ``triggered.py``)."""

    def mask_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` with the tokens not allowed next at -inf."""

    def advance(self, token: int) -> None:
        """Take the token drawn."""

    @property
    def finished(self) -> bool:
        """Whether the reply must end here."""

    @property
    def complete(self) -> bool:
        """Whether the reply so far is a whole document."""


class TokenConstraint:
    """The grammar state of one reply (module docstring). ``end_ids``: the ids that end a reply;
    ``prefix``: bytes of the document the prompt already holds. ConfigError when the prefix does
    not fit the grammar or nothing in the vocabulary can start the document."""

    def __init__(self, grammar: Grammar, end_ids: list[int], prefix: bytes = b""):
        self.grammar = grammar
        self.end_ids = [token for token in dict.fromkeys(end_ids) if 0 <= token < grammar.vocabulary.size]
        self.ends = tuple(self.end_ids)
        state = grammar.feed(grammar.initial, prefix)
        if state is None:
            raise ConfigError(f"the forced start {prefix.decode('utf-8', 'replace')!r} does not fit its grammar.")
        self.state: State = state
        self.ended = False
        """An end id was drawn."""
        if not self.allowed().any():
            raise ConfigError("no token of this vocabulary can begin a document of this grammar; decode it "
                              "without the constraint.")

    def allowed(self) -> torch.Tensor:
        """[vocabulary size] bool (CPU): the tokens that may come next."""
        mask = self.grammar.mask(self.state)
        if self.end_ids and self.complete:
            mask = mask.clone()
            mask[self.end_ids] = True
        return mask

    @property
    def complete(self) -> bool:
        """Whether the text so far is a whole document."""
        return self.grammar.complete(self.state)

    @property
    def finished(self) -> bool:
        """Whether the reply must end here: an end id was drawn, or no token may follow."""
        return self.ended or not (self.grammar.can_go_on(self.state) or self.end_ids and self.complete)

    def mask_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [..., vocab] with the tokens not allowed next set to -inf (a new tensor; ids past
        the tokenizer's, of a padded embedding, are never allowed)."""
        refused = self.grammar.refused_mask(self.state, self.ends, logits.shape[-1], logits.device)
        return logits.masked_fill(refused, float("-inf"))

    def advance(self, token: int) -> None:
        """Take the drawn ``token`` (one ``allowed`` said may come)."""
        if token in self.end_ids:
            self.ended = True
            return
        data = self.grammar.vocabulary.token_bytes[token] if token < self.grammar.vocabulary.size else None
        state = None if data is None else self.grammar.feed(self.state, data)
        if state is None:
            raise RuntimeError(f"token {token} was drawn although its grammar does not allow it here")
        self.state = state


__all__ = ["DecodingConstraint", "TokenConstraint"]
