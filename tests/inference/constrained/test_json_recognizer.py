"""The byte-level JSON recognizer (meshlm/inference/constrained/json_recognizer.py): it accepts
exactly the documents Python's ``json`` module parses (within its whitespace and number-length
limits), every prefix of a valid document stays alive, and schemas narrow what it accepts."""

import json
import random

import pytest

from meshlm.inference.constrained.json_recognizer import MAX_NUMBER_LENGTH, MAX_WHITESPACE_RUN, JsonRecognizer
from meshlm.inference.constrained.json_schema import ANY, Literal, Sequence, read_schema


def read(recognizer: JsonRecognizer, text: bytes):
    return recognizer.feed(recognizer.initial, text)


def accepts(recognizer: JsonRecognizer, text: bytes) -> bool:
    state = read(recognizer, text)
    return state is not None and recognizer.complete(state)


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(8 if depth < 3 else 6)
    if kind == 0:
        return rng.choice([True, False, None])
    if kind == 1:
        return rng.randint(-10 ** 6, 10 ** 6)
    if kind == 2:
        return rng.uniform(-1e3, 1e3) * 10 ** rng.randint(-8, 8)
    if kind in (3, 4, 5):
        return "".join(rng.choice('ab "\\\n\té€😀/\u0001') for _ in range(rng.randrange(6)))
    if kind == 6:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {f"k{i}{rng.choice(['', 'é', ' '])}": random_value(rng, depth + 1) for i in range(rng.randrange(4))}


def dumped(rng: random.Random, value) -> bytes:
    style = rng.randrange(3)
    text = (json.dumps(value) if style == 0 else json.dumps(value, indent=2, ensure_ascii=False) if style == 1
            else json.dumps(value, separators=(",", ":"), ensure_ascii=False))
    return text.encode("utf-8")


def python_parses(text: bytes) -> bool:
    try:
        json.loads(text.decode("utf-8"), parse_constant=lambda name: (_ for _ in ()).throw(ValueError(name)))
    except (ValueError, UnicodeDecodeError):
        return False
    return True


def test_every_document_python_writes_is_accepted_and_each_prefix_stays_alive():
    rng = random.Random(0)
    recognizer = JsonRecognizer(ANY)
    for _ in range(300):
        text = dumped(rng, random_value(rng))
        state = recognizer.initial
        for position, byte in enumerate(text):
            state = recognizer.advance(state, byte)
            assert state is not None, (text, position)
        assert recognizer.complete(state), text


def test_mutated_documents_are_accepted_exactly_when_python_parses_them():
    """Differential test against ``json.loads``: random single-byte edits (insert, delete, replace
    with a JSON-significant byte) of valid documents; no trailing whitespace (the recognizer ends a
    document at its last byte), no whitespace runs or numbers past the limits."""
    rng = random.Random(1)
    recognizer = JsonRecognizer(ANY)
    significant = b'{}[]:,"\\-+.eE0123456789 \ntfnul\x01\xc3\xa9\xe0\x80\xed\xa0\xf4\x90\xc0\xf5\xbf'
    seen = {True: 0, False: 0}
    for _ in range(3000):
        text = bytearray(dumped(rng, random_value(rng)))
        for _ in range(rng.randrange(1, 3)):
            position = rng.randrange(len(text) + 1)
            edit = rng.randrange(3)
            if edit == 0:
                text.insert(position, rng.choice(significant))
            elif position < len(text):
                if edit == 1:
                    del text[position]
                else:
                    text[position] = rng.choice(significant)
        text = bytes(text)
        if not text or text != text.rstrip() or b" " * (MAX_WHITESPACE_RUN + 1) in text:
            continue
        expected = python_parses(text)
        seen[expected] += 1
        assert accepts(recognizer, text) == expected, text
    assert min(seen.values()) > 300  # both kinds were exercised


def test_limits_end_runaway_whitespace_and_numbers():
    recognizer = JsonRecognizer(ANY)
    assert read(recognizer, b"[" + b" " * MAX_WHITESPACE_RUN + b"1]") is not None
    assert read(recognizer, b"[" + b" " * (MAX_WHITESPACE_RUN + 1)) is None
    assert accepts(recognizer, b"9" * MAX_NUMBER_LENGTH) and read(recognizer, b"9" * (MAX_NUMBER_LENGTH + 1)) is None
    assert read(recognizer, b"{}  ") is None  # nothing after a complete document


PERSON = {"type": "object", "required": ["name", "age"],
          "properties": {"name": {"type": "string", "minLength": 2, "maxLength": 4},
                         "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 2},
                         "pet": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/pet"}]}},
          "$defs": {"pet": {"type": "object", "properties": {"kind": {"const": "cat"}}, "required": ["kind"]}}}


@pytest.mark.parametrize("text, accepted", [
    ('{"name": "Al", "age": 3}', True),
    ('{"age":-3,"name":"Zoë"}', True),  # any key order; ë is one character
    ('{"name":"\\u00e9\\n","age":0,"tags":["b"],"pet":{"kind":"cat"}}', True),  # escapes are one character each
    ('{"name":"Al","age":3,"pet":null}', True),
    ('{"name":"A","age":3}', False),  # minLength
    ('{"name":"Alfie","age":3}', False),  # maxLength
    ('{"name":"Al"}', False),  # age is required
    ('{"name":"Al","age":3.0}', False),  # an integer
    ('{"name":"Al","age":3,"colour":1}', False),  # no other keys
    ('{"name":"Al","age":3,"age":4}', False),  # a key once
    ('{"name":"Al","age":3,"tags":[]}', False),  # minItems
    ('{"name":"Al","age":3,"tags":["a","b","a"]}', False),  # maxItems
    ('{"name":"Al","age":3,"tags":["c"]}', False),  # enum
    ('{"name":"Al","age":3,"pet":{"kind":"dog"}}', False),  # const
    ('{"name":"Al","age":3,"pet":{}}', False),  # the pet's kind is required
    ('["Al", 3]', False),
])
def test_a_schema_narrows_what_is_accepted(text, accepted):
    recognizer = JsonRecognizer(read_schema(PERSON, "s"))
    assert accepts(recognizer, text.encode()) == accepted
    assert python_parses(text.encode())


def test_a_key_is_refused_at_its_first_byte_that_no_property_starts_with():
    recognizer = JsonRecognizer(read_schema(PERSON, "s"))
    assert read(recognizer, b'{"na') is not None and read(recognizer, b'{"nb') is None
    assert read(recognizer, b'{"name":"Al","na') is None  # name was written already
    assert read(recognizer, b'{"name":"Al"}') is None  # age is missing: the object may not close


def test_a_sequence_reads_its_parts_in_turn_and_a_recursive_schema_nests():
    call = Sequence((read_schema({"type": "object", "properties": {"a": {"type": "number"}}}, "s"),
                     Literal(b"\n</tool_call>")))
    recognizer = JsonRecognizer(call)
    assert accepts(recognizer, b'{"a": 1}\n</tool_call>') and not accepts(recognizer, b'{"a": 1}')
    assert accepts(recognizer, b'{"a": 12}  \n</tool_call>')  # whitespace before the marker is JSON's
    assert read(recognizer, b'{"a": 1}\n</tool_cal!') is None
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}
    nested = JsonRecognizer(read_schema(tree, "s"))
    assert accepts(nested, b'{"kids":[{"kids":[{"kids":[]},{}]}]}') and not accepts(nested, b'{"kids":[{"x":1}]}')


def test_a_top_level_number_is_complete_yet_may_go_on():
    recognizer = JsonRecognizer(read_schema({"type": "integer"}, "s"))
    state = read(recognizer, b"12")
    assert recognizer.complete(state) and recognizer.advance(state, b"3"[0]) is not None
    assert recognizer.advance(state, b"."[0]) is None
    assert not accepts(recognizer, b"-") and not accepts(recognizer, b"01")
