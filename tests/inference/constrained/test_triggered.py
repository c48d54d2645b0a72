"""Constraints over part of a reply (meshlm/inference/constrained/triggered.py): the answer after a
think block, and each tool call a model opens among free text."""

import json

import torch

from meshlm.inference.constrained.grammar import Grammar
from meshlm.inference.constrained.json_schema import read_schema
from meshlm.inference.constrained.triggered import AfterThinking, CallsInText
from meshlm.inference.constrained.vocabulary import Vocabulary

END, THINK, UNTHINK, MARKER = 0, 1, 2, 3
"""Special ids of the test vocabulary (no text); ids from 4 are every byte."""
VOCABULARY = Vocabulary([None] * 4 + [bytes([byte]) for byte in range(256)] + [b'{"', b'"}', b"true", b"Paris"])


def token(data: bytes) -> int:
    return VOCABULARY.token_bytes.index(data)


def allowed(constraint, vocab: int = VOCABULARY.size) -> set[int]:
    return set(constraint.mask_logits(torch.zeros(vocab)).isfinite().nonzero().flatten().tolist())


def test_after_thinking_the_document_holds_and_the_reply_ends_with_it():
    grammar = Grammar(read_schema({"type": "boolean"}, "s"), VOCABULARY)
    thinking = AfterThinking(grammar, [END], (THINK, UNTHINK))
    first = allowed(thinking)
    assert THINK in first and token(b"t") in first and token(b"x") not in first and END not in first
    thinking.advance(THINK)
    during = allowed(thinking)
    assert token(b"x") in during and UNTHINK in during and END not in during  # free, but no end before the answer
    for piece in (b"x", b"y"):
        thinking.advance(token(piece))
        assert not thinking.finished and not thinking.complete
    thinking.advance(UNTHINK)
    assert allowed(thinking) == allowed(AfterThinking(grammar, [END], (THINK, UNTHINK))) - {THINK}
    thinking.advance(token(b"true"))
    assert thinking.complete and allowed(thinking) == {END} and not thinking.finished
    thinking.advance(END)
    assert thinking.finished
    direct = AfterThinking(grammar, [END], (THINK, UNTHINK))  # a reply that does not think
    direct.advance(token(b"f"))
    assert THINK not in allowed(direct) and allowed(direct) == {token(b"a")}


def test_calls_in_text_hold_each_call_after_its_marker_and_only_calls_or_the_end_follow():
    call = read_schema({"type": "object", "required": ["name", "arguments"],
                        "properties": {"name": {"const": "wx"},
                                       "arguments": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}}, "s")
    calls = CallsInText(Grammar(call, VOCABULARY), MARKER, [END])
    assert allowed(calls) == set(range(VOCABULARY.size))  # free text first
    for piece in (b"O", b"k"):
        calls.advance(token(piece))
    calls.advance(MARKER)
    whitespace = {token(bytes([byte])) for byte in b" \t\n\r"}
    assert allowed(calls) == {token(b"{"), token(b'{"')} | whitespace
    text = b'{"name":"wx","arguments":{"city":"Paris"}}'
    for byte in text:
        assert token(bytes([byte])) in allowed(calls)
        calls.advance(token(bytes([byte])))
    assert json.loads(text)["arguments"] == {"city": "Paris"}
    assert allowed(calls) == {MARKER, END} | whitespace and not calls.finished  # no text after the calls
    for _ in range(20):
        calls.advance(token(b"\n"))
    assert allowed(calls) == {MARKER, END}  # whitespace runs out
    calls.advance(MARKER)  # a second call, held again
    assert token(b"x") not in allowed(calls) and not calls.complete
