"""The reasoning toggle in the data (meshlm/data/reasoning.py): the system-prompt switch, the think
block's tokens and loss mask, and ``meshlm preprocess --chat`` adding ``<think>``/``</think>``."""

import json

import pytest
import tokenizers

from meshlm.data.chat import DEFAULT_SPECIAL_TOKENS, ChatTemplate, Segment, encode_segments, token_id
from meshlm.data.chat_preprocess import chat_tokenizer_folder, preprocess_chat
from meshlm.data.indexed import TokenStore
from meshlm.data.reasoning import (REASONING_SPECIAL_TOKENS, has_think_block, reasoning_mode, split_reasoning,
                                   system_with_switch, with_reasoning)
from meshlm.data.tokenizer import load_tokenizer
from meshlm.errors import DataError

THINKING = [{"role": "system", "content": "Be brief. /think"}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "<think>two and two make four</think>4"}]


@pytest.fixture(scope="module")
def think_tokenizer(tokenizer_path, tmp_path_factory):
    """The 300-token test tokenizer plus the template markers and the think tags as special tokens."""
    backend = tokenizers.Tokenizer.from_file(str(tokenizer_path))
    backend.add_special_tokens([tokenizers.AddedToken(token, special=True, normalized=False)
                                for token in DEFAULT_SPECIAL_TOKENS + REASONING_SPECIAL_TOKENS])
    out = tmp_path_factory.mktemp("think_tokenizer") / "tokenizer.json"
    backend.save(str(out))
    return load_tokenizer(out)


def test_switch_is_the_last_word_of_the_system_turn():
    assert system_with_switch(None, "on") == "/think"
    assert system_with_switch("Be brief.", "off") == "Be brief. /no_think"
    assert system_with_switch("Be brief. /think", "off") == "Be brief. /no_think"  # replaced, not stacked
    assert system_with_switch("/no_think", "on") == "/think"
    user = [{"role": "user", "content": "hi"}]
    assert with_reasoning(user, "on") == [{"role": "system", "content": "/think"}, *user]
    assert with_reasoning(user, None) == user
    original = [{"role": "system", "content": "Be brief."}, *user]
    switched = with_reasoning(original, "off")
    assert switched[0] == {"role": "system", "content": "Be brief. /no_think"} and switched[1:] == user
    assert original[0]["content"] == "Be brief."  # the input is left alone
    assert [reasoning_mode(m) for m in (switched, with_reasoning(user, "on"), original, user)] == ["off", "on", None,
                                                                                                   None]
    with pytest.raises(ValueError, match="'maybe'"):
        system_with_switch(None, "maybe")


@pytest.mark.parametrize("reply, expected", [
    ("<think>2+2=4</think>4", ("2+2=4", "4")),
    ("<think>\nstep one\n</think>\n\nThe answer is 4.", ("step one", "The answer is 4.")),
    ("  <think>cut off before the end", ("cut off before the end", "")),
    ("<think></think>4", ("", "4")),
    ("4, no thinking", (None, "4, no thinking")),
    ("The tag <think> in the middle", (None, "The tag <think> in the middle")),
])
def test_split_reasoning(reply, expected):
    assert split_reasoning(reply) == expected


def test_think_block_is_trained_with_its_tags_as_single_tokens(think_tokenizer):
    segments = ChatTemplate().segments(THINKING)
    assert segments == [
        Segment("<|system|>\nBe brief. /think<|end|>\n<|user|>\n2+2?<|end|>\n<|assistant|>\n", False),
        Segment("<think>two and two make four</think>4<|end|>", True), Segment("\n", False)]
    ids, mask = encode_segments(think_tokenizer, segments)
    encode = lambda text: think_tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    special = {token: token_id(think_tokenizer, token) for token in DEFAULT_SPECIAL_TOKENS + REASONING_SPECIAL_TOKENS}
    assert special["<think>"] == 306 and special["</think>"] == 307  # after the 300 + 6 markers
    prompt = ([special["<|system|>"]] + encode("\nBe brief. /think") + [special["<|end|>"]] + encode("\n")
              + [special["<|user|>"]] + encode("\n2+2?") + [special["<|end|>"]] + encode("\n")
              + [special["<|assistant|>"]] + encode("\n"))
    reply = ([special["<think>"]] + encode("two and two make four") + [special["</think>"]] + encode("4")
             + [special["<|end|>"]])
    assert ids.tolist() == prompt + reply + encode("\n")
    assert mask.tolist() == [0] * len(prompt) + [1] * len(reply) + [0] * len(encode("\n"))


def write_chats(path, conversations):
    path.write_text("".join(json.dumps({"messages": messages}) + "\n" for messages in conversations))
    return path


def test_preprocess_adds_the_think_tags_when_the_data_thinks(tmp_path, tokenizer_path):
    plain = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    assert has_think_block(THINKING) and not has_think_block(plain)
    preprocess_chat([write_chats(tmp_path / "t.jsonl", [plain, THINKING])], tokenizer_path, tmp_path / "think",
                    max_vocab_size=320)
    tokenizer = load_tokenizer(chat_tokenizer_folder(tmp_path / "think") / "tokenizer.json")
    base = load_tokenizer(tokenizer_path).vocab_size
    assert tokenizer.vocab_size == base + len(DEFAULT_SPECIAL_TOKENS) + 2
    assert [token_id(tokenizer, token) for token in REASONING_SPECIAL_TOKENS] == [base + 6, base + 7]
    store = TokenStore(tmp_path / "think")
    trained = tokenizer.decode(store.tokens[store.loss_mask == 1].tolist(), skip_special_tokens=False)
    assert trained == "Hello!<|end|><think>two and two make four</think>4<|end|>"

    preprocess_chat([write_chats(tmp_path / "p.jsonl", [plain])], tokenizer_path, tmp_path / "plain")
    tokenizer = load_tokenizer(chat_tokenizer_folder(tmp_path / "plain") / "tokenizer.json")
    assert tokenizer.vocab_size == base + len(DEFAULT_SPECIAL_TOKENS) and token_id(tokenizer, "<think>") is None


def test_the_think_tags_count_against_the_vocabulary_limit(tmp_path, tokenizer_path):
    with pytest.raises(DataError, match="</think> would give 308 ids, more than --max-vocab-size 307"):
        preprocess_chat([write_chats(tmp_path / "t.jsonl", [THINKING])], tokenizer_path, tmp_path / "s",
                        max_vocab_size=307)


def test_an_unclosed_think_block_is_refused_naming_the_line(tmp_path, tokenizer_path):
    unclosed = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>hmm 4"}]
    chats = write_chats(tmp_path / "c.jsonl", [THINKING, unclosed])
    with pytest.raises(DataError, match=r"line 2: message 1 \(assistant\) opens <think> but never closes it"):
        preprocess_chat([chats], tokenizer_path, tmp_path / "s")
