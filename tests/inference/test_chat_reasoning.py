"""``meshlm generate --chat --reasoning on|off`` (meshlm/inference/chat.py): the switch in the prompt's
tokens, a reply's think block split from its answer, and the refusals."""

import json

import pytest
import torch

from meshlm.checkpoint.model_files import load_model, save_model
from meshlm.cli import main
from meshlm.data.chat import DEFAULT_SPECIAL_TOKENS, token_id
from meshlm.data.reasoning import REASONING_SPECIAL_TOKENS
from meshlm.data.tokenizer import load_tokenizer
from meshlm.inference.chat import chat_prompt, reply_ids, reply_record, show_reply, split_reply
from meshlm.inference.generate import generate
from meshlm.inference.sampling import SamplingConfig
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel
from tests.helpers.generation_model import scripted_model



def tiny_model() -> LanguageModel:
    torch.manual_seed(0)
    return LanguageModel(ModelConfig(vocab_size=320, hidden_size=32, pattern="*-*-", num_attention_heads=4,
                                     num_kv_heads=2, init_std=0.1))


@pytest.fixture(scope="module")
def thinking_chain(tokenizer):
    """The ids a scripted model answers with after the assistant header: a think block over two
    ordinary tokens, one answer token, the end of the turn."""
    special = {token: token_id(tokenizer, token) for token in DEFAULT_SPECIAL_TOKENS + REASONING_SPECIAL_TOKENS}
    newline = tokenizer.encode("\n", add_special_tokens=False)
    [cat], [dog], [mat] = (tokenizer.encode(word, add_special_tokens=False) for word in (" cat", " dog", " mat"))
    return newline + [special["<think>"], cat, dog, special["</think>"], mat, special["<|end|>"]]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, chat_tokenizer_dir, thinking_chain):
    folder = tmp_path_factory.mktemp("reasoning_models")
    return (save_model(tiny_model(), folder / "random", tokenizer_dir=chat_tokenizer_dir),
            save_model(scripted_model(thinking_chain), folder / "thinking", tokenizer_dir=chat_tokenizer_dir))


def run_generate(capsys, *argv):
    code = main(["generate", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def hand_prompt(tokenizer, system_text: str, user_text: str) -> list[int]:
    """The default template's prompt, built token by token: markers are single ids, the text
    between them is encoded alone."""
    special = {token: token_id(tokenizer, token) for token in DEFAULT_SPECIAL_TOKENS}
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    return ([special["<|system|>"]] + encode("\n" + system_text) + [special["<|end|>"]] + encode("\n")
            + [special["<|user|>"]] + encode("\n" + user_text) + [special["<|end|>"]] + encode("\n")
            + [special["<|assistant|>"]] + encode("\n"))


def test_reasoning_writes_the_switch_into_the_system_turn(tokenizer):
    prompt, stop = chat_prompt(tokenizer, "the cat", reasoning="on")
    assert prompt == hand_prompt(tokenizer, "/think", "the cat")  # a system turn is created
    prompt, _ = chat_prompt(tokenizer, "the cat", system="Be brief.", reasoning="off")
    assert prompt == hand_prompt(tokenizer, "Be brief. /no_think", "the cat")
    assert chat_prompt(tokenizer, "the cat", system="Be brief.")[0] == hand_prompt(tokenizer, "Be brief.", "the cat")
    assert stop == [token_id(tokenizer, "<|end|>"), tokenizer.eos_token_id]


def test_generate_reasoning_prompts_with_the_switch(capsys, tokenizer, model_dirs):
    random_dir, _ = model_dirs
    for mode, switch in (("on", "/think"), ("off", "/no_think")):
        code, out, err = run_generate(capsys, random_dir, "--chat", "--reasoning", mode, "--system", "Be brief.",
                                      "--prompt", "the cat", "--max-new-tokens", 6, "--greedy", "--json", "--stats")
        assert code == 0
        prompt = hand_prompt(tokenizer, f"Be brief. {switch}", "the cat")
        assert json.loads(err)["prefill_tokens"] == len(prompt)
        stop = [token_id(tokenizer, "<|end|>"), tokenizer.eos_token_id]
        [expected] = generate(load_model(random_dir), [prompt], 6, SamplingConfig(greedy=True), eos_token_id=stop,
                              valid_vocab_size=tokenizer.vocab_size)
        assert json.loads(out)["ids"] == reply_ids(expected, stop)


def test_a_think_block_is_printed_marked_then_the_answer(capsys, tokenizer, model_dirs, thinking_chain):
    _, thinking_dir = model_dirs
    think, cat, dog, end, mat = thinking_chain[-6:-1]
    code, out, _ = run_generate(capsys, thinking_dir, "--chat", "--reasoning", "on", "--prompt", "the cat",
                                "--max-new-tokens", 10, "--greedy")
    assert code == 0 and out == "<think>cat dog</think>\nmat\n"
    code, out, _ = run_generate(capsys, thinking_dir, "--chat", "--prompt", "the cat", "--max-new-tokens", 10,
                                "--greedy", "--json")
    assert json.loads(out) == {"ids": [think, cat, dog, end, mat], "text": "mat", "thinking": "cat dog"}
    code, out, _ = run_generate(capsys, thinking_dir, "--chat", "--prompt", "the cat", "--max-new-tokens", 3,
                                "--greedy", "--json")  # cut off inside the think block
    assert json.loads(out) == {"ids": [think, cat, dog], "text": "", "thinking": "cat dog"}


def test_split_reply_by_ids_and_by_text(tokenizer, tmp_path, chat_tokenizer_dir):
    think, end = token_id(tokenizer, "<think>"), token_id(tokenizer, "</think>")
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    assert split_reply(tokenizer, [think] + encode("the cat") + [end] + encode(" a dog")) == ("the cat", "a dog")
    assert split_reply(tokenizer, encode(" a dog")) == (None, " a dog")  # no block: the reply as decoded
    assert split_reply(tokenizer, []) == (None, "")
    plain = load_tokenizer(chat_tokenizer_dir.parent / "base.json")  # no think tags: the text is split
    assert token_id(plain, "<think>") is None
    assert split_reply(plain, plain.encode("<think>the cat</think> a dog")) == ("the cat", "a dog")
    record = reply_record(tokenizer, [think] + encode("the cat") + [end] + encode("a dog"))
    assert show_reply(record) == "<think>the cat</think>\na dog"
    assert show_reply(reply_record(tokenizer, encode("a dog"))) == "a dog"


def test_reasoning_without_chat_is_refused(capsys, model_dirs):
    random_dir, _ = model_dirs
    code, _, err = run_generate(capsys, random_dir, "--reasoning", "on", "--prompt", "the cat",
                                "--max-new-tokens", 2)
    assert code == 2 and "add --chat" in err and err.count("\n") == 1
    with pytest.raises(SystemExit):  # argparse: only on and off
        main(["generate", str(random_dir), "--chat", "--reasoning", "maybe", "--prompt", "x"])
