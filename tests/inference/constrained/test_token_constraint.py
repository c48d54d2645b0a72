"""Token masks from a recognizer state (meshlm/inference/constrained/vocabulary.py, grammar.py) and
one reply's constraint (token_constraint.py): the trie walk allows exactly the tokens whose every
byte the recognizer accepts, end ids only at a complete document, and replies drawn from random
logits under the constraint are always valid documents of their schema."""

import json
import random

import pytest
import torch

from meshlm.errors import ConfigError
from meshlm.inference.constrained.grammar import Grammar
from meshlm.inference.constrained.json_recognizer import JsonRecognizer
from meshlm.inference.constrained.json_schema import ANY, ANY_OBJECT, read_schema
from meshlm.inference.constrained.token_constraint import TokenConstraint
from meshlm.inference.constrained.vocabulary import Vocabulary

END = 0
"""The end id of the test vocabulary (a special token: no text)."""


def mixed_vocabulary() -> Vocabulary:
    """Every byte, and pieces that cross JSON's structure: quotes with what follows, escapes, parts of
    UTF-8 characters, words, numbers, whitespace runs."""
    pieces = [bytes([byte]) for byte in range(256)] + [
        b'"', b'",', b'":', b'": "', b'"}', b'"]', b'\\n', b'\\u00', b'\\"', b"abc", b" the", b"name", b'"name',
        b"age", b'"age":', b"true", b"null", b" null", b"12", b"3.5", b"e-", b"}\n", b"\n  ", b"  ", b"{\"",
        b"[1,", "é".encode(), "é".encode()[:1], "😀".encode()[1:], b"\xff\xfe", b"a\x01", b"cat", b'cat"}',
        b'"cat"', b"kind", b"pet", b"tags", b"[\"a\"]", b"Al", b"Zo", "ë".encode(), b"00", b"-0"]
    return Vocabulary([None] + pieces)  # id 0: the end token


def brute_force(recognizer: JsonRecognizer, vocabulary: Vocabulary, state) -> list[int]:
    return [token for token, data in enumerate(vocabulary.token_bytes)
            if data and recognizer.feed(state, data) is not None]


PERSON = {"type": "object", "required": ["name", "age"],
          "properties": {"name": {"type": "string", "minLength": 2, "maxLength": 4},
                         "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
                         "pet": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/pet"}]}},
          "$defs": {"pet": {"type": "object", "properties": {"kind": {"const": "cat"}}, "required": ["kind"]}}}


@pytest.mark.parametrize("node, documents", [
    (ANY, [b'{"name": "a\\n\xc3\xa9\xf0\x9f\x98\x80", "k": [1, -2.5e3, true, null, {}]}', b'"just text"', b"-0.5"]),
    (read_schema(PERSON, "s"), [b'{"name":"Zo\xc3\xab","age":12,"tags":["a","b"],"pet":{"kind":"cat"}}',
                                b'{ "age" : 3 , "name" : "Al" , "pet" : null }']),
    (ANY_OBJECT, [b'{"free key \\"x\\"": "v", "n": 1}']),
])
def test_the_trie_walk_allows_exactly_the_tokens_the_recognizer_accepts(node, documents):
    """At every state along each document, the walk (with its shortcut over plain-text subtrees)
    equals trying every token on its own."""
    vocabulary = mixed_vocabulary()
    recognizer = JsonRecognizer(node)
    for document in documents:
        state = recognizer.initial
        for byte in document:
            assert sorted(vocabulary.allowed_ids(recognizer, state)) == brute_force(recognizer, vocabulary, state)
            state = recognizer.advance(state, byte)
        assert recognizer.complete(state)


def test_end_ids_are_allowed_only_at_a_complete_document():
    grammar = Grammar(read_schema(PERSON, "s"), mixed_vocabulary())
    constraint = TokenConstraint(grammar, [END])
    assert not constraint.allowed()[END] and not constraint.complete
    for piece in (b"{", b'"name', b'": "', b"Al", b'",', b'"age":', b"12"):
        constraint.advance(mixed_vocabulary().token_bytes.index(piece))
        assert not constraint.allowed()[END]
    constraint.advance(mixed_vocabulary().token_bytes.index(b"}"))
    allowed = constraint.allowed()
    assert constraint.complete and allowed[END] and allowed.sum() == 1 and not constraint.finished
    constraint.advance(END)
    assert constraint.finished and constraint.ended
    alone = TokenConstraint(grammar, [], prefix=b'{"name": "Al", "age": 1')
    alone.advance(mixed_vocabulary().token_bytes.index(b"}"))
    assert alone.finished and not alone.ended  # nothing can follow and no end id: the reply ends by itself


def test_mask_logits_covers_a_padded_vocabulary_and_refusals_are_clear():
    vocabulary = mixed_vocabulary()
    grammar = Grammar(read_schema({"type": "boolean"}, "s"), vocabulary)
    constraint = TokenConstraint(grammar, [END])
    logits = torch.zeros(2, vocabulary.size + 7)
    masked = constraint.mask_logits(logits)
    allowed = {vocabulary.token_bytes[token] for token in masked[0].isfinite().nonzero().flatten().tolist()}
    assert allowed == {b"t", b"f", b"true", b" ", b"\n", b"\t", b"\r", b"  ", b"\n  "}
    assert not masked[:, vocabulary.size:].isfinite().any()
    with pytest.raises(ConfigError, match="does not fit its grammar"):
        TokenConstraint(grammar, [END], prefix=b"maybe")
    with pytest.raises(ConfigError, match="no token of this vocabulary can begin"):
        TokenConstraint(Grammar(read_schema({"const": "x"}, "s"), Vocabulary([None, b"a"])), [])
    with pytest.raises(RuntimeError, match="does not allow it here"):
        constraint.advance(vocabulary.token_bytes.index(b"null"))


def valid_person(text: str) -> bool:
    value = json.loads(text)
    return (isinstance(value, dict) and set(value) <= set(PERSON["properties"]) and {"name", "age"} <= set(value)
            and isinstance(value["name"], str) and 2 <= len(value["name"]) <= 4
            and isinstance(value["age"], int) and not isinstance(value["age"], bool)
            and all(tag in ("a", "b") for tag in value.get("tags", [])) and len(value.get("tags", [])) <= 2
            and value.get("pet", None) in (None, {"kind": "cat"}))


def test_replies_drawn_from_random_logits_are_valid_documents_of_their_schema():
    """200 replies sampled from random logits under the constraint: every one that ends (an end id,
    or no token may follow) is valid UTF-8, parses and satisfies the schema."""
    vocabulary = mixed_vocabulary()
    grammar = Grammar(read_schema(PERSON, "s"), vocabulary)
    generator = torch.Generator().manual_seed(0)
    ended = 0
    for reply in range(200):
        constraint = TokenConstraint(grammar, [END] if reply % 2 else [])
        drawn = []
        for _ in range(300):
            logits = constraint.mask_logits(torch.randn(vocabulary.size, generator=generator) * 3)
            token = int(torch.multinomial(logits.softmax(-1), 1, generator=generator))
            constraint.advance(token)
            drawn.append(token)
            if constraint.finished:
                break
        if constraint.finished:
            ended += 1
            text = b"".join(vocabulary.token_bytes[token] for token in drawn if token != END).decode("utf-8")
            assert valid_person(text), text
    assert ended >= 150


def test_every_character_of_a_free_string_is_the_same_state():
    """Why masks are remembered per state: inside a string without length bounds each plain
    character leaves the state as it was, so a long value costs one walk."""
    recognizer = JsonRecognizer(read_schema({"type": "object", "properties": {"text": {"type": "string"}}}, "s"))
    state = recognizer.feed(recognizer.initial, b'{"text": "')
    assert {recognizer.feed(state, b"a long value, " * n) for n in range(1, 20)} == {state}


def test_a_real_tokenizers_vocabulary(tokenizer):
    """The chat BPE of the inference tests (byte-level, special markers): masks match brute force."""
    vocabulary = Vocabulary(tokenizer.text_tokens())
    assert all(vocabulary.token_bytes[token] is None for token in (tokenizer.eos_token_id,))
    recognizer = JsonRecognizer(read_schema(PERSON, "s"))
    state = recognizer.initial
    for byte in b'{"name": "the", "age": 42, "tags": ["a"]}':
        assert sorted(vocabulary.allowed_ids(recognizer, state)) == brute_force(recognizer, vocabulary, state)
        state = recognizer.advance(state, byte)


def test_random_bytes_vocabulary_agrees_with_brute_force():
    rng = random.Random(3)
    pieces = [bytes(rng.choice(b'{}[]:,"\\ \nab1-.e\xc3\xa9\x80tn') for _ in range(rng.randrange(1, 5))) for _ in range(600)]
    vocabulary = Vocabulary(pieces)
    recognizer = JsonRecognizer(ANY)
    state = recognizer.initial
    for byte in b'[{"a": "b\\n", "": [1.5, -2, true]}, "x", null]':
        assert sorted(vocabulary.allowed_ids(recognizer, state)) == brute_force(recognizer, vocabulary, state)
        state = recognizer.advance(state, byte)


def test_a_grammar_cache_builds_the_vocabulary_once_and_keeps_grammars_by_schema(tokenizer):
    from meshlm.inference.constrained.grammar import GRAMMARS_KEPT, GrammarCache

    cache = GrammarCache(tokenizer, tokenizer.vocab_size + 5)  # a padded model vocabulary: the extra ids never text
    first = cache.grammar("a", read_schema({"type": "object"}, "s"))
    assert cache.grammar("a", read_schema({"type": "string"}, "s")) is first  # kept by its key
    assert cache.vocabulary.size == tokenizer.vocab_size + 5 and cache.vocabulary.token_bytes[-1] is None
    for index in range(GRAMMARS_KEPT):
        assert cache.grammar(f"k{index}", ANY).vocabulary is cache.vocabulary
    assert cache.grammar("a", ANY) is not first  # the least recently used was dropped
