"""Reading tool calls out of a reply (meshlm/inference/tool_calls.py): meshlm's default marker,
Hermes' tags, Mistral's [TOOL_CALLS] (a list, or name[ARGS]json per call) and Llama 3's JSON reply,
the content before them, and plain text back when a call is malformed."""

import json

import pytest

from meshlm.data.chat import ChatTemplate
from meshlm.inference.constrained.json_recognizer import JsonRecognizer
from meshlm.inference.tool_calls import (DEFAULT_SYNTAX, HERMES_SYNTAX, LLAMA3_SYNTAX, MISTRAL_SYNTAX,
                                         forced_call_grammar, forced_call_prefix, split_tool_calls, tool_call_syntax)


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
    ('[TOOL_CALLS][{"name": "wx", "arguments": {}}', MISTRAL_SYNTAX),      # an unclosed list
    ('[TOOL_CALLS]wx{"city": "Oslo"}', MISTRAL_SYNTAX),                     # neither a list nor [ARGS]
    ('{"parameters": {}} is what I would send', LLAMA3_SYNTAX),             # prose after JSON, no name
    ('The answer is {"name": "wx"}', LLAMA3_SYNTAX),                        # JSON inside prose: text
])
def test_anything_but_well_formed_calls_stays_text(text, syntax):
    assert split_tool_calls(text, syntax) == (text, [])


def test_mistral_lists_and_named_calls_and_llama_3_json_replies():
    listed = '[TOOL_CALLS][{"name": "wx", "arguments": {"city": "Oslo"}}, {"name": "now", "arguments": {}}]'
    assert [(call.name, json.loads(call.arguments)) for call in split_tool_calls(listed, MISTRAL_SYNTAX)[1]] == [
        ("wx", {"city": "Oslo"}), ("now", {})]
    named = 'Sure. [TOOL_CALLS]wx[ARGS]{"city": "Oslo"}[TOOL_CALLS]now[ARGS]{}'
    content, calls = split_tool_calls(named, MISTRAL_SYNTAX)
    assert content == "Sure. " and [(call.name, json.loads(call.arguments)) for call in calls] == [
        ("wx", {"city": "Oslo"}), ("now", {})]
    content, calls = split_tool_calls(' {"name": "wx", "parameters": {"city": "Oslo"}}', LLAMA3_SYNTAX)
    assert content == " " and [(call.name, json.loads(call.arguments)) for call in calls] == [("wx", {"city": "Oslo"})]


def test_the_syntax_is_the_templates(chat_tokenizer_dir, tokenizer):
    assert tool_call_syntax(tokenizer, ChatTemplate()) == DEFAULT_SYNTAX  # the marker is one token here
    hermes = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if tools %}<tool_call>{% endif %}"
    assert tool_call_syntax(tokenizer, ChatTemplate(hermes, source="qwen-like")) == HERMES_SYNTAX
    mistral = ("{% for m in messages %}{{ m['content'] }}{% endfor %}{% if tools %}[AVAILABLE_TOOLS]{% endif %}"
               "[TOOL_CALLS]")
    assert tool_call_syntax(tokenizer, ChatTemplate(mistral)) == MISTRAL_SYNTAX
    llama = "{% if tools %}Given the following functions, please respond with a JSON{% endif %}"
    assert tool_call_syntax(tokenizer, ChatTemplate(llama)) == LLAMA3_SYNTAX
    assert tool_call_syntax(tokenizer, ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}")) is None


@pytest.mark.parametrize("reply, syntax, content", [
    ('Sure.<tool_call>\n{"name": "wx", "arguments": {}}\n</tool_call>', HERMES_SYNTAX, "Sure."),
    ('{"name": "wx", "parameters": {}}', LLAMA3_SYNTAX, ""),
    ('I think {"name": "wx"} is wrong', LLAMA3_SYNTAX, 'I think {"name": "wx"} is wrong'),
])
def test_a_streamed_reply_sends_its_content_and_never_a_call(tokenizer, reply, syntax, content):
    """Token by token (``meshlm serve``'s ``ReplyText``): the pieces sent join to the content alone,
    the calls are read when the reply ends; a reply that is not a call is all sent."""
    from meshlm.inference.server import ReplyText

    text = ReplyText(tokenizer, [tokenizer.eos_token_id], [], chat=True, tool_syntax=syntax)
    sent = ""
    for token in tokenizer.encode(reply, add_special_tokens=False):
        text.add(token)
        sent += text.new_pieces()[1]
    text.add(tokenizer.eos_token_id)
    sent += text.new_pieces(final=True)[1]
    assert sent == content and text.text == content
    assert [call.name for call in text.calls] == (["wx"] if content != reply else [])


FORCED_CALLS = [
    (DEFAULT_SYNTAX, None, '{"name":"wx","arguments":{"c":1}}', '{"c":1}}'),
    (HERMES_SYNTAX, "<tool_call>", '{"name": "wx", "arguments": {"c": 1}}\n</tool_call>', '{"c": 1}}\n</tool_call>'),
    (MISTRAL_SYNTAX, "[TOOL_CALLS]", '{"name": "wx", "arguments": {"c": 1}}]', '{"c": 1}}]'),
    (MISTRAL_SYNTAX, "[TOOL_CALLS][ARGS]", 'wx[ARGS]{"c": 1}', '{"c": 1}'),
    (LLAMA3_SYNTAX, "Given the following functions", '"name": "wx", "parameters": {"c": 1}}', '{"c": 1}}'),
]


@pytest.mark.parametrize("syntax, template, required_rest, named_rest", FORCED_CALLS)
def test_a_forced_calls_start_and_what_the_model_writes_after_it_read_as_one_call(syntax, template, required_rest,
                                                                                   named_rest):
    """``tool_choice`` required (the marker) or a named function (the call up to its arguments): the
    prefix and the rest a model would write parse as the call, in each format."""
    chat_template = ChatTemplate(template) if template else ChatTemplate()
    for prefix, rest in ((forced_call_prefix(syntax, chat_template), required_rest),
                         (forced_call_prefix(syntax, chat_template, "wx"), named_rest)):
        content, calls = split_tool_calls(prefix + rest, syntax)
        assert content == "" and [(call.name, json.loads(call.arguments)) for call in calls] == [("wx", {"c": 1})]


TOOLS = [{"type": "function", "function": {"name": "wx", "parameters": {
    "type": "object", "properties": {"c": {"type": "integer"}}, "required": ["c"]}}},
         {"type": "function", "function": {"name": "clock", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string", "format": "tz"}}}}}]


@pytest.mark.parametrize("syntax, template, required_rest, named_rest", FORCED_CALLS)
def test_a_forced_calls_grammar_holds_the_rest_to_one_call_of_an_offered_function(syntax, template, required_rest,
                                                                                  named_rest):
    """``forced_call_grammar``: from the part of the prefix after the format's marker, the rest a model
    would write is a whole document; arguments off their function's schema, a function not offered or
    a second call are refused; a function whose parameters cannot be held to takes any object."""
    chat_template = ChatTemplate(template) if template else ChatTemplate()
    for name, rest in ((None, required_rest), ("wx", named_rest)):
        key, node, written = forced_call_grammar(syntax, chat_template, TOOLS, name)
        prefix = forced_call_prefix(syntax, chat_template, name)
        assert prefix.endswith(written.decode()) and (syntax.whole_reply or prefix.startswith(syntax.start))
        recognizer = JsonRecognizer(node)
        state = recognizer.feed(recognizer.initial, written)
        done = recognizer.feed(state, rest.encode())
        assert done is not None and recognizer.complete(done), (prefix, rest)
        assert recognizer.feed(done, b" ") is None and recognizer.feed(done, syntax.start.encode()) is None
        for wrong in ('"c": "1"', '"c": 1, "d": 2', '"d": 1'):  # a string, a key not in the schema, c missing
            assert recognizer.feed(state, rest.replace('"c": 1', wrong).replace('"c":1', wrong).encode()) is None
        assert key != forced_call_grammar(syntax, chat_template, TOOLS[:1], name)[0]
    key, node, written = forced_call_grammar(syntax, chat_template, TOOLS, None)
    recognizer = JsonRecognizer(node)
    state = recognizer.feed(recognizer.initial, written)
    other = required_rest.replace('"wx"', '"clock"').replace("wx[", "clock[").replace('"c": 1', '"zone": "x"')
    assert recognizer.complete(recognizer.feed(state, other.replace('"c":1', '"zone":"x"').encode()))
    assert recognizer.feed(state, required_rest.replace("wx", "rain").encode()) is None
