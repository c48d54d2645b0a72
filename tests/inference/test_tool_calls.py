"""Reading tool calls out of a reply (meshlm/inference/tool_calls.py): meshlm's default marker and
Hermes' tags, the content before them, and plain text back when a call is malformed."""

import json

import pytest

from meshlm.data.chat import ChatTemplate
from meshlm.inference.tool_calls import DEFAULT_SYNTAX, HERMES_SYNTAX, split_tool_calls, tool_call_syntax


def test_default_marker_calls_and_the_content_before_them():
    text = 'Checking.<|tool_call|>{"name":"wx","arguments":{"city":"Paris"}}<|tool_call|>{"name":"now","arguments":{}}'
    content, calls = split_tool_calls(text, DEFAULT_SYNTAX)
    assert content == "Checking." and [call.name for call in calls] == ["wx", "now"]
    assert json.loads(calls[0].arguments) == {"city": "Paris"} and calls[1].arguments == "{}"
    assert calls[0].id.startswith("call_") and calls[0].id != calls[1].id
    assert calls[0].as_openai() == {"id": calls[0].id, "type": "function",
                                    "function": {"name": "wx", "arguments": '{"city": "Paris"}'}}


def test_hermes_tags_with_string_arguments_and_whitespace_between_calls():
    text = ('<tool_call>\n{"name": "wx", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n</tool_call>\n'
            '<tool_call>\n{"name": "now", "parameters": {"tz": "UTC"}}\n</tool_call>')
    content, calls = split_tool_calls(text, HERMES_SYNTAX)
    assert content == "" and [(call.name, json.loads(call.arguments)) for call in calls] == [
        ("wx", {"city": "Oslo"}), ("now", {"tz": "UTC"})]


@pytest.mark.parametrize("text, syntax", [
    ('Sure.<|tool_call|>{"name": "wx", "arguments": {', DEFAULT_SYNTAX),   # cut off mid-JSON
    ('<|tool_call|>{"arguments": {}}', DEFAULT_SYNTAX),                     # no name
    ('<tool_call>{"name": "wx"}', HERMES_SYNTAX),                           # never closed
    ('<tool_call>{"name": "wx"}</tool_call> and then prose', HERMES_SYNTAX),  # text after a call
    ("no calls at all", HERMES_SYNTAX),
])
def test_anything_but_well_formed_calls_stays_text(text, syntax):
    assert split_tool_calls(text, syntax) == (text, [])


def test_the_syntax_is_the_templates(chat_tokenizer_dir, tokenizer):
    assert tool_call_syntax(tokenizer, ChatTemplate()) == DEFAULT_SYNTAX  # the marker is one token here
    hermes = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if tools %}<tool_call>{% endif %}"
    assert tool_call_syntax(tokenizer, ChatTemplate(hermes, source="qwen-like")) == HERMES_SYNTAX
    assert tool_call_syntax(tokenizer, ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}")) is None
