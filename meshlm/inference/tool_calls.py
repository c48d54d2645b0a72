"""Tool calls in a reply: where a model writes them, and reading them back out of its text.

A chat model offered tools (``meshlm/data/chat.py``: ``tools`` rendered into the prompt) answers
either with text or with one or more calls, each a JSON object ``{"name": ..., "arguments":
{...}}`` in a form its chat format defines. Four formats are read:

* meshlm's default template: ``<|tool_call|>{"name": ..., "arguments": {...}}`` per call, after
  the reply's content (``chat.tool_call_json`` writes them so for training); the marker is a
  special token, so the reply is read with special tokens kept;
* Hermes' (NousResearch; Qwen 2.5, Qwen 3 and the many templates that copied it):
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` per call;
* Mistral's: ``[TOOL_CALLS]`` then a JSON list of calls (``[{"name", "arguments"}, ...]``), or in
  its newer tokenizers ``[TOOL_CALLS]name[ARGS]{...}`` per call;
* Llama 3.1-3.3's custom tools: the whole reply is one JSON object ``{"name": ...,
  "parameters": {...}}`` (recognized by the template's "Given the following functions" prompt).

``tool_call_syntax`` picks the one a tokenizer's template writes (None: no format meshlm can
read, and ``meshlm serve`` refuses ``tools`` for it). ``split_tool_calls`` cuts a reply at its
first call marker (Llama's: a reply that opens with ``{``): the text before it is the reply's
content, and the calls are parsed from the rest. A call whose JSON does not parse, or that lacks
a name, makes the whole reply plain text again (as vLLM's parsers fall back), so nothing the
model wrote is lost.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from meshlm.data.chat import ChatTemplate, token_id
from meshlm.data.tokenizer import Tokenizer
from meshlm.errors import ConfigError
from meshlm.inference.constrained.json_schema import (ANY_OBJECT, Choice, Literal, Node, ObjectNode, Sequence,
                                                      json_bytes, read_schema)


@dataclass(frozen=True)
class ToolCallSyntax:
    """How a chat format marks a call: the text before its JSON and, if any, after it; ``whole_reply``:
    the reply itself is the call's JSON, no marker (``start`` is then its first character)."""

    start: str
    end: str | None = None
    name: str = ""
    whole_reply: bool = False

    def call_start(self, text: str) -> int:
        """Where the calls begin in ``text`` (-1: no call begun)."""
        if self.whole_reply:
            stripped = text.lstrip()
            return len(text) - len(stripped) if stripped.startswith(self.start) else -1
        return text.find(self.start)


DEFAULT_SYNTAX = ToolCallSyntax("<|tool_call|>", None, "meshlm default")
HERMES_SYNTAX = ToolCallSyntax("<tool_call>", "</tool_call>", "hermes")
MISTRAL_SYNTAX = ToolCallSyntax("[TOOL_CALLS]", None, "mistral")
LLAMA3_SYNTAX = ToolCallSyntax("{", None, "llama 3 json", whole_reply=True)
MISTRAL_ARGUMENTS = "[ARGS]"
LLAMA3_TOOLS_PROMPT = "Given the following functions"
"""What Llama 3.1-3.3's templates write before the offered functions (custom tool calling)."""


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
    for syntax in (HERMES_SYNTAX, MISTRAL_SYNTAX):
        if syntax.start in template.jinja:
            return syntax
    return LLAMA3_SYNTAX if LLAMA3_TOOLS_PROMPT in template.jinja else None


def forced_call_prefix(syntax: ToolCallSyntax, template: ChatTemplate, name: str | None = None) -> str:
    """The start of a reply that is a call, for ``tool_choice`` "required" (the format's marker) or
    a named function (the call's JSON too, up to its arguments): put at the end of the prompt, it
    leaves the model only the rest of a call to write, which ``forced_call_grammar`` holds to."""
    quoted = json.dumps(name) if name is not None else None
    if syntax is DEFAULT_SYNTAX:
        return syntax.start + ("" if name is None else '{"name":' + quoted + ',"arguments":')
    if syntax is HERMES_SYNTAX:
        return syntax.start + "\n" + ("" if name is None else '{"name": ' + quoted + ', "arguments": ')
    if syntax is MISTRAL_SYNTAX:
        if MISTRAL_ARGUMENTS in (template.jinja or ""):  # name[ARGS]{...}
            return syntax.start + ("" if name is None else name + MISTRAL_ARGUMENTS)
        return syntax.start + "[" + ("" if name is None else '{"name": ' + quoted + ', "arguments": ')
    return "{" + ("" if name is None else '"name": ' + quoted + ', "parameters": ')  # Llama 3: the reply is the call


def forced_call_grammar(syntax: ToolCallSyntax, template: ChatTemplate, tools: list[dict],
                        name: str | None = None) -> tuple[str, Node, bytes]:
    """(a key naming it, the grammar, the part of it the prompt holds) of the call a forced ``tool_choice``
    makes the model write: the text after the format's marker (Llama 3's: the whole reply) -- one
    call's JSON with the name one of ``tools``' (or ``name``) and the arguments that function's
    parameters schema, then the format's closing text. Its start is the end of
    ``forced_call_prefix``, which the prompt already holds. A function whose parameters use keywords
    decoding cannot hold to (``json_schema.read_schema`` refuses them) gets any JSON object as its
    arguments."""
    arguments = "parameters" if syntax is LLAMA3_SYNTAX else "arguments"
    calls = []
    for index, tool in enumerate(tools):
        function = tool["function"]
        if name is not None and function["name"] != name:
            continue
        try:
            parameters = read_schema(function.get("parameters") or {"type": "object"},
                                     f"tools[{index}].function.parameters")
        except ConfigError:
            parameters = ANY_OBJECT
        if syntax is MISTRAL_SYNTAX and MISTRAL_ARGUMENTS in (template.jinja or ""):
            calls.append(Sequence((Literal((function["name"] + MISTRAL_ARGUMENTS).encode()), parameters)))
        else:
            calls.append(ObjectNode({b"name": Literal(json_bytes(function["name"])), arguments.encode(): parameters},
                                    frozenset({b"name", arguments.encode()})))
    call = calls[0] if len(calls) == 1 else Choice(tuple(calls))
    if syntax is HERMES_SYNTAX:
        call = Sequence((call, Literal(("\n" + syntax.end).encode())))
    elif syntax is MISTRAL_SYNTAX and MISTRAL_ARGUMENTS not in (template.jinja or ""):
        call = Sequence((Literal(b"["), call, Literal(b"]")))
    prefix = forced_call_prefix(syntax, template, name)
    written = prefix if syntax.whole_reply else prefix[len(syntax.start):]
    key = json.dumps({"syntax": syntax.name, "tools": tools, "name": name, "jinja": template.jinja or ""},
                     sort_keys=True)
    return key, call, written.encode()


def split_tool_calls(text: str, syntax: ToolCallSyntax) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a reply's ``text`` (module docstring); no calls: (text, [])."""
    first = syntax.call_start(text)
    if first < 0:
        return text, []
    calls = []
    for call in call_objects(text[first:], syntax) or [None]:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
            return text, []
        arguments = call.get("arguments", call.get("parameters", {}))
        arguments = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        calls.append(ToolCall(call["name"], arguments, f"call_{uuid.uuid4().hex[:24]}"))
    return text[:first], calls


def call_objects(calls_text: str, syntax: ToolCallSyntax) -> list | None:
    """The JSON values of the calls written in ``calls_text`` (from the first marker on), or None
    when they are not well formed: unparsable JSON, an unclosed call, text after one."""
    try:
        if syntax.whole_reply:
            return [json.loads(calls_text)]
        pieces = calls_text.split(syntax.start)[1:]
        if syntax is MISTRAL_SYNTAX and MISTRAL_ARGUMENTS in calls_text:  # name[ARGS]{...} per call
            named = [piece.split(MISTRAL_ARGUMENTS, 1) for piece in pieces]
            return [{"name": pair[0].strip(), "arguments": json.loads(pair[1])} if len(pair) == 2 else None
                    for pair in named]
        if syntax is MISTRAL_SYNTAX:  # one JSON list of calls
            listed = json.loads("".join(pieces))
            return listed if isinstance(listed, list) else [listed]
        found = []
        for piece in pieces:
            if syntax.end is not None:
                if syntax.end not in piece or piece.split(syntax.end, 1)[1].strip():
                    return None
                piece = piece.split(syntax.end, 1)[0]
            found.append(json.loads(piece))
        return found
    except json.JSONDecodeError:
        return None


__all__ = ["DEFAULT_SYNTAX", "HERMES_SYNTAX", "LLAMA3_SYNTAX", "MISTRAL_SYNTAX", "ToolCall", "ToolCallSyntax",
           "forced_call_grammar", "forced_call_prefix", "split_tool_calls", "tool_call_syntax"]
