"""Which tokens of a vocabulary a recognizer state allows: a byte trie walked once per state.

A token may be drawn when every one of its bytes is accepted in turn (``json_recognizer.py``).
Trying the 32k-150k tokens of a vocabulary one by one before every drawn token would cost seconds;
instead the tokens' bytes are laid out as a trie (tokens sharing a first byte share a node, and so
on down), and one depth-first walk advances the recognizer along each edge, leaving a whole
subtree the moment its edge is refused -- so most of the vocabulary is ruled out at its first
byte. Inside a string almost every token is allowed; a subtree that is string text all the way
down (no quote, backslash or control byte, well-formed UTF-8: ``TrieNode.string_text``) is then
taken whole without walking it, and inside a string with a ``maxLength`` a subtree of plain ASCII
(``PLAIN_TEXT_BYTES``), down to the depth the length leaves room for. Finally the
masks are remembered per state: a reply's states repeat (every character of a long string value
is the same state), so most tokens cost one dictionary lookup. This is the approach of
llguidance and of the token-trie walks in Outlines' and XGrammar's papers (Willard & Louf 2023,
"Efficient Guided Generation for Large Language Models"; Dong et al. 2024, "XGrammar"), kept in
plain Python.

Special tokens (``Tokenizer.is_special``: control tokens such as an end of turn) are not text and
are left out of the trie; the constraint allows the ids that end a reply separately, once the
document is complete (``token_constraint.py``). The masks are remembered by ``grammar.py``.
"""

from __future__ import annotations

from meshlm.inference.constrained.json_recognizer import (ESCAPE, PLAIN_TEXT_BYTES, QUOTE, UNBOUNDED, JsonRecognizer,
                                                          State, string_byte)

class TrieNode:
    __slots__ = ("byte", "children", "ids", "plain", "height", "_levels", "_subtree_ids", "_text")

    def __init__(self, byte: int | None = None):
        self.byte = byte
        """The byte of the edge into this node (None at the root)."""
        self.children: dict[int, TrieNode] = {}
        self.ids: list[int] = []
        """The tokens whose bytes end here."""
        self.plain = True
        """Whether every byte below this node is plain text (the edge into it too)."""
        self.height = 0
        """How many bytes the longest path below this node holds."""
        self._levels: list[list[int]] | None = None
        self._subtree_ids: list[int] | None = None
        self._text: dict[int, bool] = {}

    def string_text(self, phase: int = 0) -> bool:
        """Whether every path from the edge into this node down, read inside a JSON string from
        ``phase`` (0: between characters), stays string content: no closing quote, backslash or
        control byte, well-formed UTF-8 so far (``json_recognizer.string_byte``). Computed once per
        phase, on first asking."""
        known = self._text.get(phase)
        if known is None:
            moved = None if phase == 0 and self.byte == QUOTE else string_byte(phase, self.byte)
            known = moved is not None and moved[0] != ESCAPE and all(
                child.string_text(moved[0]) for child in self.children.values())
            self._text[phase] = known
        return known

    def levels(self) -> list[list[int]]:
        """The tokens ending at this node (``[0]``) and 1, 2, ... bytes below it (computed once)."""
        if self._levels is None:
            self._levels, frontier = [], [self]
            while frontier:
                self._levels.append([token for node in frontier for token in node.ids])
                frontier = [child for node in frontier for child in node.children.values()]
        return self._levels

    def ids_within(self, depth: int) -> list[int]:
        """The tokens ending at this node or at most ``depth`` bytes below it."""
        if depth >= self.height:
            if self._subtree_ids is None:
                self._subtree_ids = [token for level in self.levels() for token in level]
            return self._subtree_ids
        return [token for level in self.levels()[:depth + 1] for token in level]


class Vocabulary:
    """A tokenizer's text tokens as a byte trie. ``token_bytes[i]``: the bytes of token i, None for a
    special token (or one beyond the ids the model draws)."""

    def __init__(self, token_bytes: list[bytes | None]):
        self.size = len(token_bytes)
        self.token_bytes = token_bytes
        self.root = TrieNode()
        for token, data in enumerate(token_bytes):
            if not data:
                continue
            node = self.root
            for byte in data:
                node = node.children.get(byte) or node.children.setdefault(byte, TrieNode(byte))
            node.ids.append(token)
        self._mark_plain(self.root)
        self.whitespace_ids = [token for token, data in enumerate(token_bytes) if data and not data.strip(b" \t\n\r")]
        """The tokens that are JSON whitespace only."""

    @classmethod
    def of_tokenizer(cls, tokenizer, size: int) -> Vocabulary:
        """The first ``size`` ids of ``tokenizer`` (the ones the model draws from)."""
        return cls([None if token >= tokenizer.vocab_size or tokenizer.is_special(token)
                    else tokenizer.token_bytes(token) for token in range(size)])

    def _mark_plain(self, root: TrieNode) -> None:
        order, pending = [], [(root, None)]
        while pending:  # parents before children; marked in reverse
            node, byte = pending.pop()
            order.append((node, byte))
            pending += [(child, child_byte) for child_byte, child in node.children.items()]
        for node, byte in reversed(order):
            node.plain = (byte is None or byte in PLAIN_TEXT_BYTES) and all(
                child.plain for child in node.children.values())
            node.height = 1 + max((child.height for child in node.children.values()), default=-1)

    def allowed_ids(self, recognizer: JsonRecognizer, state: State) -> list[int]:
        """The tokens every byte of which ``recognizer`` accepts in turn from ``state``."""
        allowed: list[int] = []
        pending = [(self.root, state)]
        while pending:
            node, at = pending.pop()
            in_text = recognizer.plain_room(at) == UNBOUNDED  # in a string free to run: text needs no walk
            for byte, child in node.children.items():
                if in_text and child.string_text():
                    allowed += child.ids_within(UNBOUNDED)
                    continue
                moved = recognizer.advance(at, byte)
                if moved is None:
                    continue
                room = recognizer.plain_room(moved) if child.plain else None
                if room is not None:  # plain text below, free to run that far: no need to walk it
                    allowed += child.ids_within(room)
                else:
                    allowed += child.ids
                    if child.children:
                        pending.append((child, moved))
        return allowed


__all__ = ["Vocabulary"]
