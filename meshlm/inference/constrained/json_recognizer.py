"""Reading a JSON document one byte at a time against a schema's grammar (``json_schema.py``).

Constrained decoding asks, before every token, which tokens keep the reply on a path to a
document the schema accepts. A token is a few bytes, so the question becomes: from what has been
read so far, which bytes may come next? A pushdown recognizer answers it: its *state* is the
stack of the values being read (the object whose key is being spelt, the array around it, the
string inside it, ...), and one byte either moves it to a new state or is refused.

Each frame of the stack is a small tuple:

    (ROOT,)                                   the bottom; a document is complete when only it is left
    (VALUE, node)                             a value of ``node`` may start here (after whitespace)
    (OBJECT, node, phase, seen keys, value)   inside ``{...}``: after '{', after ',', after a key
                                              (then ``value`` is the node its value must match),
                                              or after a value
    (KEY, object node, spelt, phase)          inside a key's quotes (``spelt``: the bytes so far,
                                              kept when the key decides its value's node)
    (ARRAY, node, phase, count)               inside ``[...]``: after '[', after ',', after an item
    (STRING, node, phase, characters)         inside a string's quotes
    (NUMBER, integer, phase, length)          inside a number (it ends at the first byte that
                                              cannot extend it, which then belongs to its parent)
    (LITERAL, text, position)                 part way through ``true``, a const, a marker

A string's phase follows escapes (``\\n``, ``\\u00e9``) and multi-byte UTF-8 characters, so a
constrained reply is valid UTF-8 and valid JSON; control characters are refused inside strings,
as JSON requires. Where a schema offers several options (``anyOf``, a list of types, an enum),
every option still possible is followed at once: a state is the set of stacks of each live
option (Earley-style, without the merging), and an option dies at the first byte it refuses.

Two limits keep a model from running on where the grammar would let it: at most
``MAX_WHITESPACE_RUN`` whitespace bytes in a row between tokens (a model that keeps writing
newlines would otherwise never finish), and numbers of at most ``MAX_NUMBER_LENGTH`` bytes.

States are hashable (tuples and frozensets of them) and the recognizer remembers every step it
has taken (``advance``), so a reply's hundreds of tokens, and the vocabulary walks behind them
(``vocabulary.py``), mostly revisit states already met.
"""

from __future__ import annotations

import sys
from itertools import chain

from meshlm.inference.constrained.json_schema import (ANY_ARRAY, ANY_NUMBER, ANY_OBJECT, ANY_STRING, FALSE, NULL,
                                                      TRUE, AnyValue, ArrayNode, Choice, Literal, Node, NumberNode,
                                                      ObjectNode, Sequence, StringNode, resolved)

ROOT, VALUE, OBJECT, KEY, ARRAY, STRING, NUMBER, LITERAL = range(8)
OBJECT_OPEN, OBJECT_NEXT_KEY, OBJECT_COLON, OBJECT_AFTER_VALUE = range(4)
ARRAY_OPEN, ARRAY_NEXT_ITEM, ARRAY_AFTER_ITEM = range(3)
MINUS, ZERO, INTEGER_DIGITS, DOT, FRACTION, EXPONENT, EXPONENT_SIGN, EXPONENT_DIGITS = range(8)
NUMBER_ENDS = frozenset({ZERO, INTEGER_DIGITS, FRACTION, EXPONENT_DIGITS})
"""Number phases at which the number may end."""
ESCAPE = 1
"""String phase after a backslash; 0 is plain text, -k: k hex digits of a ``\\u`` escape left,
10 + k: k continuation bytes of a UTF-8 character left, a lead byte of ``UTF8_NARROW_SECOND``: its
second byte next."""
UTF8_NARROW_SECOND = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}
"""Lead bytes whose second byte has a narrower range (no overlong forms, surrogates or code points past
U+10FFFF: RFC 3629, §4)."""
MAX_WHITESPACE_RUN = 20
MAX_NUMBER_LENGTH = 32
WHITESPACE = frozenset(b" \t\n\r")
DIGITS = frozenset(b"0123456789")
HEX_DIGITS = frozenset(b"0123456789abcdefABCDEF")
SIMPLE_ESCAPES = frozenset(b'"\\/bfnrt')
QUOTE, BACKSLASH, COLON, COMMA = b'"'[0], b"\\"[0], b":"[0], b","[0]
OPEN_BRACE, CLOSE_BRACE, OPEN_BRACKET, CLOSE_BRACKET = b"{"[0], b"}"[0], b"["[0], b"]"[0]
PLAIN_TEXT_BYTES = frozenset(range(0x20, 0x7F)) - {QUOTE, BACKSLASH}
"""ASCII bytes that may stand anywhere in a string as themselves."""

State = frozenset
"""A recognizer state: the set of (whitespace run, stack) configurations still alive."""


def string_byte(phase: int, byte: int) -> tuple[int, bool] | None:
    """(next phase, whether a character was completed) of a string's content at ``phase`` reading
    ``byte`` (not its closing quote), or None where JSON forbids it."""
    if phase == 0:
        if byte == BACKSLASH:
            return ESCAPE, False
        if byte < 0x20:
            return None
        if byte < 0x80:
            return 0, True
        if 0xC2 <= byte <= 0xDF:
            return 11, False
        if byte in UTF8_NARROW_SECOND:
            return byte, False  # a lead byte whose next byte has a narrower range: the phase is the lead byte
        if 0xE0 <= byte <= 0xEF:
            return 12, False
        if 0xF0 <= byte <= 0xF4:
            return 13, False
        return None
    if phase == ESCAPE:
        if byte in SIMPLE_ESCAPES:
            return 0, True
        return (-4, False) if byte == b"u"[0] else None
    if phase < 0:
        return (phase + 1, phase == -1) if byte in HEX_DIGITS else None
    low, high = UTF8_NARROW_SECOND.get(phase, (0x80, 0xBF))
    if not low <= byte <= high:  # not a UTF-8 continuation byte (that may stand here)
        return None
    if phase in UTF8_NARROW_SECOND:
        return (12 if phase >= 0xF0 else 11), False
    return (0, True) if phase == 11 else (phase - 1, False)


def number_byte(integer: bool, phase: int, byte: int) -> int | None:
    """The next phase of a number at ``phase`` reading ``byte``, or None where it cannot go on."""
    digit = byte in DIGITS
    fraction_or_exponent = not integer and phase in (ZERO, INTEGER_DIGITS, FRACTION)
    if phase == MINUS:
        return ZERO if byte == b"0"[0] else INTEGER_DIGITS if digit else None
    if phase == INTEGER_DIGITS and digit:
        return INTEGER_DIGITS
    if fraction_or_exponent and byte in b"eE":
        return EXPONENT
    if not integer and phase in (ZERO, INTEGER_DIGITS) and byte == b"."[0]:
        return DOT
    if phase in (DOT, FRACTION) and digit:
        return FRACTION
    if phase == EXPONENT and byte in b"+-":
        return EXPONENT_SIGN
    if phase in (EXPONENT, EXPONENT_SIGN, EXPONENT_DIGITS) and digit:
        return EXPONENT_DIGITS
    return None


def start_value(node: Node, byte: int, below: tuple) -> tuple:
    """The configurations where a value of ``node`` begins with ``byte`` above the frames ``below``."""
    node = resolved(node)
    if isinstance(node, Choice):
        return tuple(chain.from_iterable(start_value(option, byte, below) for option in node.options))
    if isinstance(node, Sequence):
        for part in reversed(node.parts[1:]):
            below = below + ((VALUE, part),)
        return start_value(node.parts[0], byte, below)
    if isinstance(node, AnyValue):
        node = {OPEN_BRACE: ANY_OBJECT, OPEN_BRACKET: ANY_ARRAY, QUOTE: ANY_STRING, b"t"[0]: TRUE, b"f"[0]: FALSE,
                b"n"[0]: NULL}.get(byte, ANY_NUMBER)
    if isinstance(node, ObjectNode):
        return ((0, below + ((OBJECT, node, OBJECT_OPEN, frozenset(), None),)),) if byte == OPEN_BRACE else ()
    if isinstance(node, ArrayNode):
        return ((0, below + ((ARRAY, node, ARRAY_OPEN, 0),)),) if byte == OPEN_BRACKET else ()
    if isinstance(node, StringNode):
        return ((0, below + ((STRING, node, 0, 0),)),) if byte == QUOTE else ()
    if isinstance(node, NumberNode):
        phase = number_byte(node.integer, MINUS, byte) if byte != b"-"[0] else MINUS
        return () if phase is None else ((0, below + ((NUMBER, node.integer, phase, 1),)),)
    if isinstance(node, Literal):
        if byte != node.text[0]:
            return ()
        return ((0, below if len(node.text) == 1 else below + ((LITERAL, node.text, 1),)),)
    raise TypeError(f"not a grammar node: {node!r}")


def more_keys(node: ObjectNode, seen: frozenset) -> bool:
    return node.additional is not None or len(seen) < len(node.properties)


def step(configuration: tuple, byte: int) -> tuple:
    """The configurations one ``configuration`` (whitespace run, stack) moves to on ``byte`` (none: refused)."""
    run, stack = configuration
    top = stack[-1]
    kind, below = top[0], stack[:-1]
    if kind == STRING:
        _, node, phase, characters = top
        if phase == 0 and byte == QUOTE:
            return ((0, below),) if characters >= node.min_length else ()
        if phase == 0 and node.max_length is not None and characters >= node.max_length:
            return ()  # the byte would begin one character too many
        moved = string_byte(phase, byte)
        if moved is None:
            return ()
        if moved[1] and node.counted:
            characters += 1
        return ((0, below + ((STRING, node, moved[0], characters),)),)
    if kind == KEY:
        return key_step(top, below, byte)
    if kind == NUMBER:
        _, integer, phase, length = top
        moved = number_byte(integer, phase, byte)
        if moved is not None:  # within the length, and not stuck at it part way (``1.``)
            fits = length + 1 < MAX_NUMBER_LENGTH or length + 1 == MAX_NUMBER_LENGTH and moved in NUMBER_ENDS
            return ((0, below + ((NUMBER, integer, moved, length + 1),)),) if fits else ()
        return step((0, below), byte) if phase in NUMBER_ENDS else ()  # the byte belongs to what follows
    if kind == LITERAL:
        _, text, position = top
        if byte != text[position]:
            return ()
        return ((0, below if position + 1 == len(text) else below + ((LITERAL, text, position + 1),)),)
    if kind == ROOT:
        return ()
    if byte in WHITESPACE:
        skipped = ((run + 1, stack),) if run < MAX_WHITESPACE_RUN else ()
        return skipped + start_value(top[1], byte, below) if kind == VALUE else skipped  # a marker may open so
    if kind == VALUE:
        return start_value(top[1], byte, below)
    if kind == OBJECT:
        return object_step(top, below, byte)
    _, node, phase, count = top  # ARRAY
    if phase == ARRAY_AFTER_ITEM:
        if byte == COMMA and node.item(count) is not None:
            return ((0, below + ((ARRAY, node, ARRAY_NEXT_ITEM, count),)),)
        return ((0, below),) if byte == CLOSE_BRACKET and count >= node.min_items else ()
    if byte == CLOSE_BRACKET and phase == ARRAY_OPEN:
        return ((0, below),) if node.min_items == 0 else ()
    item = node.item(count)
    return () if item is None else start_value(item, byte, below + ((ARRAY, node, ARRAY_AFTER_ITEM, count + 1),))


def object_step(top: tuple, below: tuple, byte: int) -> tuple:
    _, node, phase, seen, value = top
    if phase == OBJECT_COLON:
        if byte != COLON:
            return ()
        return ((0, below + ((OBJECT, node, OBJECT_AFTER_VALUE, seen, None), (VALUE, value))),)
    if phase == OBJECT_AFTER_VALUE:
        if byte == COMMA and more_keys(node, seen):
            return ((0, below + ((OBJECT, node, OBJECT_NEXT_KEY, seen, None),)),)
        return ((0, below),) if byte == CLOSE_BRACE and node.required <= seen else ()
    if byte == QUOTE and more_keys(node, seen):
        spelt = b"" if node.properties else None  # a key is kept only where it picks its value's node
        return ((0, below + (top, (KEY, node, spelt, 0))),)
    if byte == CLOSE_BRACE and phase == OBJECT_OPEN and not node.required:
        return ((0, below),)
    return ()


def key_step(top: tuple, below: tuple, byte: int) -> tuple:
    _, node, spelt, phase = top
    _, _, _, seen, _ = below[-1]
    if phase == 0 and byte == QUOTE:  # the key is complete: it decides the node of its value
        if spelt is not None and spelt in node.properties:
            if spelt in seen:
                return ()
            value, seen = node.properties[spelt], seen | {spelt}
        elif node.additional is not None:
            value = node.additional
        else:
            return ()
        return ((0, below[:-1] + ((OBJECT, node, OBJECT_COLON, seen, value),)),)
    if node.additional is None:  # only the known keys not yet written
        spelt += bytes((byte,))
        if not any(name not in seen for name in node.keys_starting(spelt)):
            return ()
        return ((0, below + ((KEY, node, spelt, 0),)),)
    moved = string_byte(phase, byte)
    if moved is None:
        return ()
    return ((0, below + ((KEY, node, None if spelt is None else spelt + bytes((byte,)), moved[0]),)),)


def configuration_complete(configuration: tuple) -> bool:
    stack = configuration[1]
    if len(stack) == 1:
        return True
    return len(stack) == 2 and stack[1][0] == NUMBER and stack[1][2] in NUMBER_ENDS


UNBOUNDED = sys.maxsize


def plain_room(configuration: tuple) -> int | None:
    """How many more ``PLAIN_TEXT_BYTES`` may follow where ``configuration`` is, each keeping it alive
    -- inside a string (as many as its ``maxLength`` leaves) or a free key, at plain text -- or None
    where plain text is not free to run."""
    top = configuration[1][-1]
    if top[0] == STRING and top[2] == 0:
        return UNBOUNDED if top[1].max_length is None else top[1].max_length - top[3]
    return UNBOUNDED if top[0] == KEY and top[3] == 0 and top[1].additional is not None else None


class JsonRecognizer:
    """The recognizer of one grammar ``node`` (module docstring); remembers each step it takes."""

    def __init__(self, node: Node):
        self.node = node
        self.initial: State = frozenset({(0, ((ROOT,), (VALUE, node)))})
        self._steps: dict[tuple[State, int], State | None] = {}
        self._room: dict[State, int | None] = {}
        self._complete: dict[State, bool] = {}

    def advance(self, state: State, byte: int) -> State | None:
        """The state after ``byte``, or None where no live option accepts it."""
        key = (state, byte)
        try:
            return self._steps[key]
        except KeyError:
            pass
        moved = frozenset(chain.from_iterable(step(configuration, byte) for configuration in state)) or None
        self._steps[key] = moved
        return moved

    def feed(self, state: State | None, data: bytes) -> State | None:
        """The state after every byte of ``data`` (None once one is refused)."""
        for byte in data:
            if state is None:
                return None
            state = self.advance(state, byte)
        return state

    def complete(self, state: State) -> bool:
        """Whether the bytes read so far are a whole document (it may still go on: ``12`` -> ``123``)."""
        if state not in self._complete:
            self._complete[state] = any(configuration_complete(configuration) for configuration in state)
        return self._complete[state]

    def plain_room(self, state: State) -> int | None:
        """How many plain ASCII bytes may follow ``state``, each keeping it alive (``plain_room`` of its
        configurations: the most any of them allows), or None."""
        if state not in self._room:
            rooms = [room for room in map(plain_room, state) if room is not None]
            self._room[state] = max(rooms) if rooms else None
        return self._room[state]


__all__ = ["JsonRecognizer", "MAX_NUMBER_LENGTH", "MAX_WHITESPACE_RUN", "PLAIN_TEXT_BYTES", "State"]
