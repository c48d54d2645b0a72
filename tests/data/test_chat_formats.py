"""meshlm/data/chat_formats.py: ShareGPT, Alpaca and prompt/completion records read as the same
conversations as ``messages``, so their stores are byte for byte the messages store."""

import json

import pytest

from meshlm.data.chat_formats import conversation
from meshlm.data.chat_preprocess import preprocess_chat
from meshlm.data.indexed import TokenStore
from meshlm.errors import DataError

SECOND = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
          {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"},
          {"role": "assistant", "content": "6"}]
CALL = {"name": "add", "arguments": {"a": 2, "b": 2}}
TOOL_USE = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "content": "4"}, {"role": "assistant", "content": "It is 4."}]
SHAREGPT = [
    {"system": "Be brief.", "conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"},
                                              {"from": "human", "value": "and 3+3?"}, {"from": "gpt", "value": "6"}]},
    {"conversations": [{"from": "human", "value": "2+2?"}, {"from": "function_call", "value": json.dumps(CALL)},
                       {"from": "observation", "value": "4"}, {"from": "gpt", "value": "It is 4."}]},
]
ALPACA = [
    {"instruction": "Translate to French.", "input": "cheese", "output": "fromage"},
    {"instruction": "And this?", "input": "", "output": "pain", "system": "Be brief.",
     "history": [["Translate to French.\n\ncheese", "fromage"]]},
]
PROMPT_COMPLETION = [{"prompt": "Hi", "completion": "Hello!"},
                     {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                      "completion": [{"role": "assistant", "content": "Hello!"}]}]


def test_each_shape_gives_its_messages():
    assert conversation(SHAREGPT[0], "x") == SECOND
    assert conversation(SHAREGPT[1], "x") == TOOL_USE
    assert conversation(ALPACA[0], "x") == [{"role": "user", "content": "Translate to French.\n\ncheese"},
                                            {"role": "assistant", "content": "fromage"}]
    assert conversation(ALPACA[1], "x") == [{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "Translate to French.\n\ncheese"},
                                            {"role": "assistant", "content": "fromage"},
                                            {"role": "user", "content": "And this?"},
                                            {"role": "assistant", "content": "pain"}]
    assert conversation(PROMPT_COMPLETION[0], "x") == [{"role": "user", "content": "Hi"},
                                                       {"role": "assistant", "content": "Hello!"}]
    assert conversation(PROMPT_COMPLETION[1], "x")[0] == {"role": "system", "content": "Be brief."}
    assert conversation({"messages": SECOND, "prompt": "ignored", "completion": "ignored"}, "x") == SECOND


def test_stores_of_every_shape_equal_the_messages_store(tmp_path, tokenizer_path):
    messages = [conversation(record, "x") for record in [*SHAREGPT, *ALPACA, *PROMPT_COMPLETION]]
    (tmp_path / "messages.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in messages))
    (tmp_path / "mixed.json").write_text(json.dumps([*SHAREGPT, *ALPACA, *PROMPT_COMPLETION]))  # one .json array
    for name in ("messages.jsonl", "mixed.json"):
        preprocess_chat([tmp_path / name], tokenizer_path, tmp_path / name.split(".")[0], max_vocab_size=320)
    expected, got = TokenStore(tmp_path / "messages"), TokenStore(tmp_path / "mixed")
    assert len(got) == 6 and got.tokens.tolist() == expected.tokens.tolist()
    assert got.loss_mask.tolist() == expected.loss_mask.tolist() and got.offsets.tolist() == expected.offsets.tolist()


@pytest.mark.parametrize("record, message", [
    ({"text": "hi"}, r"x: not a conversation \(keys here: 'text'\); each record must be one of .*ShareGPT.*Alpaca"),
    ({"conversations": [{"from": "bot", "value": "hi"}]}, r"conversations\[0\] is from 'bot'; use one of human"),
    ({"conversations": [{"from": "human"}]}, r"conversations\[0\] needs a string 'value'"),
    ({"conversations": [{"from": "function_call", "value": "add(2, 2)"}]}, "function_call whose value is not JSON"),
    ({"instruction": "a", "output": 3}, "'output' must be a string, got int"),
    ({"instruction": "a", "output": "b", "history": [["q"]]}, "'history' must be a list of"),
    ({"prompt": 1, "completion": "b"}, "'prompt' must be a string or a list of messages"),
    ([1, 2], "x: a JSON list, not an object"),
])
def test_a_record_of_no_known_shape_is_refused_with_its_keys(record, message):
    with pytest.raises(DataError, match=message):
        conversation(record, "x")
