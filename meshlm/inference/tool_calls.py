"""Tool calls in a reply: where a model writes them, and reading them back out of its text.

A chat model offered tools (``meshlm/data/chat.py``: ``tools`` rendered into the prompt) answers
either with text or with one or more calls, each a JSON object ``{"name": ..., "arguments":
{...}}`` behind a marker its chat format defines. Two formats are read:

* meshlm's default template: ``<|tool_call|>{"name": ..., "arguments": {...}}`` per call, after
  the reply's content (``chat.tool_call_json`` writes them so for training); the marker is a
  special token, so the reply is read with special tokens kept;
* Hermes' (NousResearch; Qwen 2.5, Qwen 3 and the many templates that copied it):
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` per call.

``tool_call_syntax`` picks the one a tokenizer's template writes (None: no format meshlm can
read, and ``meshlm serve`` refuses ``tools`` for it). ``split_tool_calls`` cuts a reply at its
first call marker: the text before it is the reply's content, and the calls are parsed from the
rest. A call whose JSON does not parse, or that lacks a name, makes the whole reply plain text
again (as vLLM's parsers fall back), so nothing the model wrote is lost.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from meshlm.data.chat import ChatTemplate, token_id
from meshlm.data.tokenizer import Tokenizer


@dataclass(frozen=True)
class ToolCallSyntax:
    """How a chat format marks a call: the text before its JSON and, if any, after it."""

    start: str
    end: str | None = None
    name: str = ""


DEFAULT_SYNTAX = ToolCallSyntax("<|tool_call|>", None, "meshlm default")
HERMES_SYNTAX = ToolCallSyntax("<tool_call>", "</tool_call>", "hermes")


@dataclass(frozen=True)
class ToolCall:
    """One call read from a reply, as OpenAI's API returns it: ``arguments`` a JSON string."""

    name: str
    arguments: str
    id: str

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def tool_call_syntax(tokenizer: Tokenizer, template: ChatTemplate) -> ToolCallSyntax | None:
    """The call format of ``template`` (meshlm's default template: its marker, which needs the
    tokenizer to hold it as one token; a Jinja template: Hermes' when it writes ``<tool_call>``),
    or None when meshlm cannot read this model's calls."""
    if template.is_default:
        return DEFAULT_SYNTAX if token_id(tokenizer, DEFAULT_SYNTAX.start) is not None else None
    return HERMES_SYNTAX if HERMES_SYNTAX.start in template.jinja else None


def split_tool_calls(text: str, syntax: ToolCallSyntax) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a reply's ``text`` (module docstring); no calls: (text, [])."""
    first = text.find(syntax.start)
    if first < 0:
        return text, []
    calls, rest = [], text[first:]
    for piece in rest.split(syntax.start)[1:]:
        if syntax.end is not None:
            if syntax.end not in piece or piece.split(syntax.end, 1)[1].strip():
                return text, []  # an unclosed call, or text after one: not a well-formed call
            piece = piece.split(syntax.end, 1)[0]
        try:
            call = json.loads(piece)
        except json.JSONDecodeError:
            return text, []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
            return text, []
        arguments = call.get("arguments", call.get("parameters", {}))
        arguments = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        calls.append(ToolCall(call["name"], arguments, f"call_{uuid.uuid4().hex[:24]}"))
    return text[:first], calls


__all__ = ["DEFAULT_SYNTAX", "HERMES_SYNTAX", "ToolCall", "ToolCallSyntax", "split_tool_calls", "tool_call_syntax"]
