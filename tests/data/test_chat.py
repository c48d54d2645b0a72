import json

import numpy as np
import pytest
import tokenizers

from meshlm.data.chat import (DEFAULT_SPECIAL_TOKENS, ChatTemplate, Segment, check_messages, encode_segments,
                              load_chat_template, missing_special_tokens)
from meshlm.data.tokenizer import load_tokenizer
from meshlm.errors import DataError

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"type": "function", "function": {"name": "wx", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}]


@pytest.fixture(scope="module")
def chat_tokenizer(tokenizer_path, tmp_path_factory):
    """The 300-token test tokenizer plus the default template's markers as special tokens."""
    backend = tokenizers.Tokenizer.from_file(str(tokenizer_path))
    backend.add_special_tokens([tokenizers.AddedToken(token, special=True, normalized=False)
                                for token in DEFAULT_SPECIAL_TOKENS])
    out = tmp_path_factory.mktemp("chat_tokenizer") / "tokenizer.json"
    backend.save(str(out))
    return load_tokenizer(out)


def test_default_template_segments_by_hand():
    assert ChatTemplate().segments(CONVERSATION) == [
        Segment("<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n", False),
        Segment("Hello!<|end|>", True), Segment("\n<|user|>\nWeather in Paris?<|end|>\n<|assistant|>\n", False),
        Segment('<|tool_call|>{"name":"wx","arguments":{"city":"Paris"}}<|end|>', True),
        Segment("\n<|tool|>\nsunny<|end|>\n<|assistant|>\n", False), Segment("Sunny.<|end|>", True),
        Segment("\n", False)]
    assert ChatTemplate().prompt(CONVERSATION[1:2]) == "<|user|>\nHi<|end|>\n<|assistant|>\n"
    assert ChatTemplate().end_of_turn() == "<|end|>"


def test_jinja_template_mask_comes_from_prefix_renderings():
    template = ChatTemplate(CHATML, source="chatml")
    messages = [CONVERSATION[1], CONVERSATION[2]]
    assert template.segments(messages) == [
        Segment("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", False),
        Segment("Hello!<|im_end|>", True), Segment("\n", False)]
    assert "".join(s.text for s in template.segments(messages)) == template.render(messages)
    assert template.prompt(messages[:1]) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert template.end_of_turn() == "<|im_end|>"


def test_template_that_rewrites_earlier_turns_is_refused():
    rewriting = "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(DataError, match="does not extend"):
        ChatTemplate(rewriting, source="bad").segments(CONVERSATION[1:3])


def test_tokenizer_template_is_found_else_default(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "</s>"}))
    template = load_chat_template(tmp_path / "tokenizer.json")
    assert not template.is_default and template.special_tokens == {"eos_token": "</s>"}
    assert load_chat_template(tmp_path / "elsewhere" / "tokenizer.json").is_default


def test_mask_matches_hand_built_tokens(chat_tokenizer):
    ids, mask = encode_segments(chat_tokenizer, ChatTemplate().segments(CONVERSATION[1:3]))
    encode = lambda text: chat_tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    prompt, reply = encode("<|user|>\nHi<|end|>\n<|assistant|>\n"), encode("Hello!<|end|>")
    assert reply[-1] == encode("<|end|>")[0] and len(encode("<|end|>")) == 1
    assert ids.tolist() == prompt + reply + encode("\n")
    assert mask.tolist() == [0] * len(prompt) + [1] * len(reply) + [0]
    assert mask.dtype == np.uint8


def test_missing_special_tokens(tokenizer_path, chat_tokenizer):
    assert missing_special_tokens(load_tokenizer(tokenizer_path), ChatTemplate()) == list(DEFAULT_SPECIAL_TOKENS)
    assert missing_special_tokens(chat_tokenizer, ChatTemplate()) == []
    assert missing_special_tokens(load_tokenizer(tokenizer_path), ChatTemplate(CHATML)) == []


@pytest.mark.parametrize("messages, match", [
    ([], "non-empty list"),
    ([{"role": "bot", "content": "x"}], "role 'bot'"),
    ([{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}], "string 'content'"),
    ([{"role": "user", "content": "x"}], "no assistant message"),
    ([{"role": "user", "content": "x", "tool_calls": []}, {"role": "assistant", "content": "y"}], "only an assistant"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [{"args": 1}]}],
     "a tool call must be"),
])
def test_bad_conversations_are_refused_naming_where(messages, match):
    with pytest.raises(DataError, match=match) as caught:
        check_messages(messages, "chat.jsonl, line 7")
    assert str(caught.value).startswith("chat.jsonl, line 7: ")


WEATHER_TOOL = {"type": "function", "function": {"name": "wx", "description": "The weather in a city.",
                                                 "parameters": {"type": "object",
                                                                "properties": {"city": {"type": "string"}}}}}


def test_offered_tools_go_into_the_prompt_never_trained():
    """The default template lists the tools at the end of the system turn (one is added without
    one); a Jinja template gets them as ``tools``, as transformers passes them."""
    from meshlm.data.chat import TOOLS_INTRODUCTION, tool_definitions

    tools = tool_definitions([WEATHER_TOOL], "test")
    listed = TOOLS_INTRODUCTION + '\n{"name":"wx","description":"The weather in a city.","parameters":' \
                                  '{"type":"object","properties":{"city":{"type":"string"}}}}'
    segments = ChatTemplate().segments(CONVERSATION, tools)
    assert segments[0] == Segment(f"<|system|>\nBe brief.\n\n{listed}<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n",
                                  False)
    assert segments[1:] == ChatTemplate().segments(CONVERSATION)[1:]  # the trained parts do not change
    assert ChatTemplate().prompt(CONVERSATION[1:2], tools) == (f"<|system|>\n{listed}<|end|>\n<|user|>\nHi<|end|>\n"
                                                                "<|assistant|>\n")
    listing = ("{% if tools %}{{ '<|im_start|>tools\n' }}{% for tool in tools %}{{ tool.function.name + '\n' }}"
               "{% endfor %}{{ '<|im_end|>\n' }}{% endif %}")
    template = ChatTemplate(listing + CHATML, source="chatml with tools")
    assert template.prompt(CONVERSATION[1:2], tools).startswith("<|im_start|>tools\nwx\n<|im_end|>\n<|im_start|>user")
    assert template.segments(CONVERSATION[1:3], tools)[1] == Segment("Hello!<|im_end|>", True)
    assert tool_definitions([WEATHER_TOOL["function"]], "test") == tools  # the bare function object too


@pytest.mark.parametrize("tools, match", [
    ({"name": "wx"}, "must be a list of function definitions"),
    ([{"type": "retrieval"}], "only 'function' tools exist"),
    ([{"type": "function", "function": {"description": "no name"}}], "tool 0 must be"),
])
def test_bad_tool_lists_are_refused_naming_where(tools, match):
    from meshlm.data.chat import tool_definitions

    with pytest.raises(DataError, match=f"chat.jsonl, line 2: .*{match}"):
        tool_definitions(tools, "chat.jsonl, line 2")
