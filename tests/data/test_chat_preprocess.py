import json

import pytest

from meshlm.cli import main
from meshlm.data.chat import DEFAULT_SPECIAL_TOKENS, ChatTemplate, encode_segments
from meshlm.data.chat_preprocess import chat_tokenizer_folder, preprocess_chat
from meshlm.data.indexed import TokenStore
from meshlm.data.tokenizer import load_tokenizer
from meshlm.errors import DataError

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"},
     {"role": "assistant", "content": "6"}],
]


def write_chats(path, conversations):
    path.write_text("".join(json.dumps({"messages": messages}) + "\n" for messages in conversations))
    return path


def test_chat_store_holds_rendered_tokens_and_masks(tmp_path, tokenizer_path):
    chats = write_chats(tmp_path / "chats.jsonl", CONVERSATIONS)
    assert main(["preprocess", "--chat", "--input", str(chats), "--tokenizer", str(tokenizer_path),
                 "--out", str(tmp_path / "sft"), "--max-vocab-size", "320"]) == 0
    store = TokenStore(tmp_path / "sft")
    tokenizer = load_tokenizer(chat_tokenizer_folder(tmp_path / "sft") / "tokenizer.json")
    base_size = load_tokenizer(tokenizer_path).vocab_size
    assert tokenizer.vocab_size == store.vocab_size == base_size + len(DEFAULT_SPECIAL_TOKENS)
    assert [tokenizer.encode(t, add_special_tokens=False) for t in DEFAULT_SPECIAL_TOKENS] == [
        [base_size + index] for index in range(len(DEFAULT_SPECIAL_TOKENS))]  # new ids after the old ones
    assert len(store) == 2 and store.loss_mask is not None
    for index, messages in enumerate(CONVERSATIONS):
        ids, mask = encode_segments(tokenizer, ChatTemplate().segments(messages))
        document = slice(store.offsets[index], store.offsets[index + 1])
        assert store.document(index).tolist() == ids.tolist()
        assert store.loss_mask[document].tolist() == mask.tolist()
    trained = tokenizer.decode(store.tokens[store.loss_mask == 1].tolist(), skip_special_tokens=False)
    assert trained == "Hello!<|end|>4<|end|>6<|end|>"
    meta = store.metadata
    assert meta["chat"] is True and meta["chat_template"] == "meshlm default"
    assert store.recorded_tokenizer().resolve() == (chat_tokenizer_folder(tmp_path / "sft") / "tokenizer.json").resolve()


def test_rewriting_a_store_without_chat_drops_the_mask(tmp_path, tokenizer_path, write_jsonl):
    preprocess_chat([write_chats(tmp_path / "c.jsonl", CONVERSATIONS)], tokenizer_path, tmp_path / "s")
    main(["preprocess", "--input", str(write_jsonl(tmp_path / "t.jsonl", ["plain"])), "--tokenizer",
          str(tokenizer_path), "--out", str(tmp_path / "s"), "--no-progress"])
    assert TokenStore(tmp_path / "s").loss_mask is None


def test_vocabulary_limit_is_refused(tmp_path, tokenizer_path):
    with pytest.raises(DataError, match="--max-vocab-size 300"):
        preprocess_chat([write_chats(tmp_path / "c.jsonl", CONVERSATIONS)], tokenizer_path, tmp_path / "s",
                        max_vocab_size=300)


@pytest.mark.parametrize("line, match", [
    ("{not json", "not valid JSON"),
    ('{"text": "hello"}', r"not a conversation \(keys here: 'text'\); each record must be one of \{\"messages\""),
    ('{"messages": [{"role": "robot", "content": "x"}]}', "role 'robot'"),
    ('{"messages": [{"role": "user", "content": "x"}]}', "no assistant message"),
])
def test_bad_lines_are_refused_naming_file_and_line(tmp_path, tokenizer_path, line, match):
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"messages": CONVERSATIONS[0]}) + "\n\n" + line + "\n")
    with pytest.raises(DataError, match=match) as caught:
        preprocess_chat([chats], tokenizer_path, tmp_path / "s")
    assert str(caught.value).startswith(f"{chats}, line 3: ")
    assert not (tmp_path / "s.bin").exists()


def test_a_records_tools_are_rendered_into_its_prompt(tmp_path, tokenizer_path):
    """``{"messages": [...], "tools": [...]}``: the offered functions are in the stored tokens, untrained."""
    from meshlm.data.chat import TOOLS_INTRODUCTION, tool_definitions

    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    calls = [{"role": "user", "content": "2+2?"},
             {"role": "assistant", "content": None, "tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 2}}]},
             {"role": "tool", "content": "4"}, {"role": "assistant", "content": "4"}]
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"messages": calls, "tools": tools}) + "\n")
    assert main(["preprocess", "--chat", "--input", str(chats), "--tokenizer", str(tokenizer_path),
                 "--out", str(tmp_path / "sft"), "--max-vocab-size", "320"]) == 0
    store = TokenStore(tmp_path / "sft")
    tokenizer = load_tokenizer(chat_tokenizer_folder(tmp_path / "sft") / "tokenizer.json")
    ids, mask = encode_segments(tokenizer, ChatTemplate().segments(calls, tool_definitions(tools, "test")))
    assert store.document(0).tolist() == ids.tolist()
    text = tokenizer.decode(store.document(0).tolist(), skip_special_tokens=False)
    assert text.startswith(f"<|system|>\n{TOOLS_INTRODUCTION}\n" + '{"name":"add"')
    trained = tokenizer.decode(store.tokens[store.loss_mask == 1].tolist(), skip_special_tokens=False)
    assert trained == '<|tool_call|>{"name":"add","arguments":{"a":2,"b":2}}<|end|>4<|end|>'
