"""Constraints that hold only part of a reply: a reasoning model's answer after its think block, and
the tool calls a model chooses to write among free text.

Both wrap ``TokenConstraint`` and keep its interface (``mask_logits``, ``advance``, ``finished``,
``complete``), so the batcher and ``generate`` draw with them alike:

* ``AfterThinking``: a reasoning model thinks freely first. If the reply opens with the think
  token, everything up to the closing one is free text (except the end of the reply: the document
  must still come); from there (or from the first token, for a reply that does not think) the
  grammar holds, and the reply ends with its document. The first token may be the grammar's or the
  think token. (vLLM holds structured outputs to the text after
  the reasoning the same way.)
* ``CallsInText``: with ``tool_choice`` "auto" the model decides whether to call; once it writes the
  call marker -- a token of its own, such as ``<|tool_call|>`` or Qwen's ``<tool_call>`` -- the call
  that follows is held to the offered functions' grammar (``tool_calls.forced_call_grammar``), and
  when the call is complete the text is free again: more text, another call, or the end.
"""

from __future__ import annotations

import torch

from meshlm.inference.constrained.grammar import Grammar
from meshlm.inference.constrained.json_recognizer import MAX_WHITESPACE_RUN
from meshlm.inference.constrained.token_constraint import TokenConstraint


class AfterThinking:
    """``grammar`` holds the reply after an optional think block (``think``: the ids that open and
    close it); ``end_ids`` end the reply once its document is complete."""

    def __init__(self, grammar: Grammar, end_ids: list[int], think: tuple[int, int]):
        self.document = TokenConstraint(grammar, end_ids)
        self.think_start, self.think_end = think
        self.phase = "first"
        """"first" (no token yet), "thinking" (inside the think block) or "answer" (the grammar holds)."""

    @property
    def ended(self) -> bool:
        return self.document.ended

    @property
    def complete(self) -> bool:
        return self.phase == "answer" and self.document.complete

    @property
    def finished(self) -> bool:
        return self.phase == "answer" and self.document.finished

    def mask_logits(self, logits: torch.Tensor) -> torch.Tensor:
        if self.phase == "thinking":  # free, but the reply may not end before its document
            ends = [token for token in self.document.end_ids if token < logits.shape[-1]]
            return logits.index_fill(-1, torch.tensor(ends, device=logits.device), float("-inf")) if ends else logits
        masked = self.document.mask_logits(logits)
        if self.phase == "first" and self.think_start < logits.shape[-1]:
            masked[..., self.think_start] = logits[..., self.think_start]  # or open a think block
        return masked

    def advance(self, token: int) -> None:
        if self.phase == "first" and token == self.think_start:
            self.phase = "thinking"
        elif self.phase == "thinking":
            if token == self.think_end:
                self.phase = "answer"
        else:
            self.phase = "answer"
            self.document.advance(token)


class CallsInText:
    """Free text in which each call the model opens with ``marker`` (a token id) is held to ``grammar``
    (the call after the marker) until complete; after a call, only whitespace (up to
    ``MAX_WHITESPACE_RUN`` bytes), another marker or one of ``end_ids`` may follow, since text after
    the calls would make them text (``tool_calls.split_tool_calls``)."""

    def __init__(self, grammar: Grammar, marker: int, end_ids: list[int]):
        self.grammar, self.marker, self.end_ids = grammar, marker, list(end_ids)
        self.call: TokenConstraint | None = None
        """The call being written, None outside calls."""
        self.after_calls: int | None = None
        """Whitespace bytes written since the last call closed (None: no call yet)."""

    ended = False
    complete = False
    """Free text is never a finished document: the reply ends by its end id or ``max_tokens``."""
    finished = False

    def mask_logits(self, logits: torch.Tensor) -> torch.Tensor:
        if self.call is not None:
            return self.call.mask_logits(logits)
        if self.after_calls is None:
            return logits
        allowed = [token for token in [self.marker, *self.end_ids] if token < logits.shape[-1]]
        if self.after_calls < MAX_WHITESPACE_RUN:
            allowed += [token for token in self.grammar.vocabulary.whitespace_ids if token < logits.shape[-1]]
        keep = torch.full_like(logits, float("-inf"))
        index = torch.tensor(allowed, device=logits.device)
        return keep.index_copy(-1, index, logits.index_select(-1, index))

    def advance(self, token: int) -> None:
        if self.call is None:
            if token == self.marker:
                self.call = TokenConstraint(self.grammar, [])
            elif self.after_calls is not None and token not in self.end_ids:
                self.after_calls += len(self.grammar.vocabulary.token_bytes[token])
            return
        self.call.advance(token)
        if self.call.finished:  # the call is closed: whitespace, another call or the end
            self.call, self.after_calls = None, 0


__all__ = ["AfterThinking", "CallsInText"]
