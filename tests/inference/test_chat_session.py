"""``meshlm chat`` (meshlm/inference/chat_session.py) driven through piped stdin: the history is
re-rendered every turn, /reset clears it, /think and /no_think change the system turn, old turns
are dropped to fit the context, and replies (think blocks included) stay in the history."""

import io
import json
import sys

import pytest
import torch

from meshlm.checkpoint.model_files import load_model, save_model
from meshlm.cli import main
from meshlm.data.chat import token_id
from meshlm.inference.chat import conversation_prompt, reply_ids
from meshlm.inference.generate import generate
from meshlm.inference.sampling import SamplingConfig
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel

MAX_NEW = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, chat_tokenizer_dir):
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(vocab_size=320, hidden_size=32, pattern="*-*-", num_attention_heads=4,
                                      num_kv_heads=2, init_std=0.1))
    return save_model(model, tmp_path_factory.mktemp("session_model") / "model", tokenizer_dir=chat_tokenizer_dir)


def run_chat(monkeypatch, capsys, lines: list[str], *argv) -> tuple[int, list[dict], str]:
    """``meshlm chat ... --json`` with ``lines`` piped to stdin: (status, reply records, stderr)."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(line + "\n" for line in lines)))
    code = main(["chat", "--greedy", "--max-new-tokens", str(MAX_NEW), "--device", "cpu", "--json", *map(str, argv)])
    captured = capsys.readouterr()
    return code, [json.loads(line) for line in captured.out.splitlines()], captured.err


def whole(tokenizer, record: dict) -> str:
    """A reply as the session keeps it in the history: decoded with its special tokens."""
    return tokenizer.decode(record["ids"], skip_special_tokens=False)


def expected_reply(model_dir, tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(prompt ids of ``messages``, the reply ids generate gives them), computed apart from the session."""
    prompt = conversation_prompt(tokenizer, messages)
    stop = [token_id(tokenizer, "<|end|>"), tokenizer.eos_token_id]
    [new] = generate(load_model(model_dir), [prompt], MAX_NEW, SamplingConfig(greedy=True), eos_token_id=stop,
                     valid_vocab_size=tokenizer.vocab_size)
    return prompt, reply_ids(new, stop)


def test_each_turn_is_rendered_after_the_whole_history(monkeypatch, capsys, model_dir, tokenizer):
    code, records, _ = run_chat(monkeypatch, capsys, ["the cat", "", "a dog sat"], model_dir, "--system", "Be brief.")
    assert code == 0 and len(records) == 2  # the blank line is no turn
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the cat"}]
    prompt_1, reply_1 = expected_reply(model_dir, tokenizer, first)
    assert records[0]["ids"] == reply_1 and records[0]["prompt_tokens"] == len(prompt_1)
    second = first + [{"role": "assistant", "content": whole(tokenizer, records[0])},
                      {"role": "user", "content": "a dog sat"}]
    prompt_2, reply_2 = expected_reply(model_dir, tokenizer, second)
    assert prompt_2[:len(prompt_1)] == prompt_1  # the second prompt holds the first turn
    assert records[1]["ids"] == reply_2 and records[1]["prompt_tokens"] == len(prompt_2)
    assert records[1]["text"] == tokenizer.decode(reply_2)


def test_reset_clears_the_history_and_exit_ends(monkeypatch, capsys, model_dir, tokenizer):
    code, records, err = run_chat(monkeypatch, capsys, ["the cat", "/reset", "a dog sat", "/exit", "the mat"],
                                  model_dir)
    assert code == 0 and len(records) == 2 and "conversation cleared" in err
    prompt, reply = expected_reply(model_dir, tokenizer, [{"role": "user", "content": "a dog sat"}])
    assert records[1]["prompt_tokens"] == len(prompt) and records[1]["ids"] == reply


def test_think_and_no_think_switch_the_system_turn(monkeypatch, capsys, model_dir, tokenizer):
    code, records, err = run_chat(monkeypatch, capsys, ["the cat", "/no_think", "a dog sat"], model_dir,
                                  "--system", "Be brief.", "--reasoning", "on")
    assert code == 0 and "reasoning off: the system turn now ends with /no_think" in err
    first = [{"role": "system", "content": "Be brief. /think"}, {"role": "user", "content": "the cat"}]
    assert records[0]["prompt_tokens"] == len(conversation_prompt(tokenizer, first))
    second = [{"role": "system", "content": "Be brief. /no_think"}, first[1],
              {"role": "assistant", "content": whole(tokenizer, records[0])}, {"role": "user", "content": "a dog sat"}]
    prompt, reply = expected_reply(model_dir, tokenizer, second)
    assert records[1]["prompt_tokens"] == len(prompt) and records[1]["ids"] == reply

    code, records, _ = run_chat(monkeypatch, capsys, ["/think", "the cat"], model_dir)  # no --system: one is made
    prompt, reply = expected_reply(model_dir, tokenizer, [{"role": "system", "content": "/think"},
                                                          {"role": "user", "content": "the cat"}])
    assert records[0]["prompt_tokens"] == len(prompt) and records[0]["ids"] == reply


def test_oldest_exchanges_are_dropped_to_fit_the_context(monkeypatch, capsys, model_dir, tokenizer):
    turns = ["the cat", "a dog sat", "the mat"]
    code, records, _ = run_chat(monkeypatch, capsys, turns, model_dir)
    full = records[2]["prompt_tokens"]
    context = full + MAX_NEW - 1  # one token short of the whole history
    code, records, err = run_chat(monkeypatch, capsys, turns, model_dir, "--max-context", context)
    assert code == 0 and len(records) == 3
    assert err.count("\n") == 1 and f"dropped the oldest 1 exchange(s) to fit the {context}-token context" in err
    kept = [{"role": "user", "content": "a dog sat"}, {"role": "assistant", "content": whole(tokenizer, records[1])},
            {"role": "user", "content": "the mat"}]
    prompt, reply = expected_reply(model_dir, tokenizer, kept)
    assert records[2]["prompt_tokens"] == len(prompt) and records[2]["ids"] == reply

    code, records, err = run_chat(monkeypatch, capsys, ["the cat " * 20, "a dog"], model_dir, "--max-context", 24)
    assert code == 0 and len(records) == 1 and "does not fit the 24-token context" in err  # the session goes on


def test_the_history_keeps_whole_replies_think_blocks_included(monkeypatch, capsys, thinking_model_dir, tokenizer):
    code, records, _ = run_chat(monkeypatch, capsys, ["the cat", "a dog"], thinking_model_dir, "--reasoning", "on",
                                "--max-new-tokens", 8)
    assert code == 0 and [(r["thinking"], r["text"]) for r in records] == [("cat dog", "mat")] * 2
    second = [{"role": "system", "content": "/think"}, {"role": "user", "content": "the cat"},
              {"role": "assistant", "content": "<think> cat dog</think> mat"}, {"role": "user", "content": "a dog"}]
    assert records[1]["prompt_tokens"] == len(conversation_prompt(tokenizer, second))

    monkeypatch.setattr(sys, "stdin", io.StringIO("the cat\n"))
    assert main(["chat", str(thinking_model_dir), "--greedy", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out == "<think>cat dog</think>\nmat\n"


def test_refusals(monkeypatch, capsys, model_dir, tmp_path):
    code, _, err = run_chat(monkeypatch, capsys, ["hi"], model_dir, "--max-context", 1)
    assert code == 2 and "--max-context 1 leaves no room" in err
    code, records, err = run_chat(monkeypatch, capsys, ["the cat"], model_dir, "--max-context", 6)
    assert code == 0 and "--max-new-tokens 4 is cut to 3, half the 6-token context" in err
    assert not records and "does not fit the 6-token context" in err
    bare = save_model(LanguageModel(ModelConfig(vocab_size=320, hidden_size=32, pattern="*-",
                                                num_attention_heads=4, num_kv_heads=2)), tmp_path / "bare")
    code, _, err = run_chat(monkeypatch, capsys, ["hi"], bare)
    assert code == 2 and "--tokenizer" in err
    code, _, err = run_chat(monkeypatch, capsys, ["hi"], model_dir, "--temperature", 0.5)
    assert code == 2 and "--greedy" in err
