"""``meshlm preprocess --preference`` and the rows a reward-model / DPO run reads (meshlm/data/preference.py).

The store's documents are the SFT rendering of each conversation cut after the judged reply, its
mask only on that reply; the dataset's rows equal labels built by hand from the tokenizer; long
conversations lose context from the left or are skipped with a count; bad input is one sentence
naming the file and line.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from meshlm.cli import main
from meshlm.data.gpt_dataset import IGNORE_INDEX
from meshlm.data.preference import PreferenceStore, build_preference_datasets, preprocess_preference, scores_path
from meshlm.data.tokenizer import load_tokenizer
from meshlm.errors import DataError
from tests.helpers.counting_corpus import write_corpus
from tests.helpers.preference_data import write_jsonl, write_store


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"), num_documents=4).parent / "tokenizer.json"


PAIRS = [
    {"prompt": "t1 t2", "chosen": "t3 t4", "rejected": "t5"},
    {"messages": [{"role": "system", "content": "t9"}, {"role": "user", "content": "t10"},
                  {"role": "assistant", "content": "t11 t12"}, {"role": "user", "content": "t13"}],
     "chosen": {"role": "assistant", "content": "t14"}, "rejected": "t15 t16 t17"},
]


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_pairs_are_stored_as_rendered_conversations_with_only_the_final_reply_trained(tmp_path, tokenizer_file):
    assert main(["preprocess", "--preference", "--input", str(write_jsonl(tmp_path / "p.jsonl", PAIRS)),
                 "--tokenizer", str(tokenizer_file), "--out", str(tmp_path / "prefs"), "--max-vocab-size", "128"]) == 0
    store = PreferenceStore(tmp_path / "prefs")
    tokenizer = load_tokenizer(tmp_path / "prefs.tokenizer" / "tokenizer.json")
    assert store.kind == "pairs" and len(store) == 2 and store.store.num_documents == 4
    context_1 = "<|system|>\nt9<|end|>\n<|user|>\nt10<|end|>\n<|assistant|>\nt11 t12<|end|>\n<|user|>\nt13<|end|>\n"
    expected = [("<|user|>\nt1 t2<|end|>\n<|assistant|>\n", "t3 t4<|end|>"),
                ("<|user|>\nt1 t2<|end|>\n<|assistant|>\n", "t5<|end|>"),
                (context_1 + "<|assistant|>\n", "t14<|end|>"),
                (context_1 + "<|assistant|>\n", "t15 t16 t17<|end|>")]
    for document, (context, reply) in enumerate(expected):
        context_ids, reply_ids = ids_of(tokenizer, context), ids_of(tokenizer, reply)
        start, stop = store.store.offsets[document], store.store.offsets[document + 1]
        assert store.store.document(document).tolist() == context_ids + reply_ids
        assert store.store.loss_mask[start:stop].tolist() == [0] * len(context_ids) + [1] * len(reply_ids)
        # the row: padded input, labels = the next token on the reply only, last_index at <|end|>
        input_ids, labels, last_index = store.row(document, 32)
        tokens = context_ids + reply_ids
        assert input_ids.tolist() == tokens + [0] * (32 - len(tokens))
        hand = [IGNORE_INDEX] * 32
        for position in range(len(context_ids) - 1, len(tokens) - 1):
            hand[position] = tokens[position + 1]
        assert labels.tolist() == hand and last_index == len(tokens) - 1
    assert store.store.metadata["preference"] == "pairs"


def test_rated_replies_keep_every_attribute_with_nan_for_missing_ratings(tmp_path, tokenizer_file):
    records = [{"messages": [{"role": "user", "content": "t1"}, {"role": "assistant", "content": "t2"}],
                "scores": {"helpfulness": 3, "verbosity": 1.5}},
               {"messages": [{"role": "user", "content": "t3"}, {"role": "assistant", "content": "t4 t5"}],
                "scores": {"correctness": 4}}]
    prefix = write_store(tmp_path, records, tokenizer_file)
    store = PreferenceStore(prefix)
    assert store.kind == "scores" and store.attributes == ["helpfulness", "verbosity", "correctness"]
    table = np.load(scores_path(prefix))
    assert np.array_equal(table, np.array([[3, 1.5, np.nan], [np.nan, np.nan, 4]], dtype=np.float32), equal_nan=True)
    dataset = build_preference_datasets([str(prefix)], 16, {"train": 3}, seed=1, split="1")["train"]
    batch = dataset.read_batch(0, 3, "cpu")
    assert batch["input_ids"].shape == (3, 16) and batch["scores"].shape == (3, 3)
    assert sorted(dataset.order.tolist()[:2]) == [0, 1]  # an epoch is a permutation of the examples


def test_a_micro_batch_of_pairs_interleaves_chosen_and_rejected_rows(tmp_path, tokenizer_file):
    records = [{"prompt": f"t{i}", "chosen": f"t{i + 20} t{i + 21}", "rejected": f"t{i + 40}"} for i in range(6)]
    dataset = build_preference_datasets([str(write_store(tmp_path, records, tokenizer_file))], 12,
                                        {"train": 12}, seed=3, split="1")["train"]
    batch = dataset.read_batch(2, 3, "cpu")
    assert batch["input_ids"].shape == (6, 12) and batch["last_index"].shape == (6,)
    for row in range(3):
        example = int(dataset.examples[dataset.order[2 + row]][1])
        chosen, rejected = batch["input_ids"][2 * row].tolist(), batch["input_ids"][2 * row + 1].tolist()
        assert chosen[1] == rejected[1] == example  # the same prompt t{example}
        assert chosen[4] == example + 20 and rejected[4] == example + 40
    assert sorted(dataset.order[:6].tolist()) == list(range(6)) and sorted(dataset.order[6:].tolist()) == list(range(6))


def test_long_conversations_lose_context_from_the_left_or_are_skipped_with_a_count(tmp_path, tokenizer_file):
    records = [{"prompt": "t1 t2 t3 t4 t5 t6", "chosen": "t7 t8", "rejected": "t9"},
               {"prompt": "t1", "chosen": "t2 t3 t4 t5 t6 t7 t8", "rejected": "t9"}]
    prefix = str(write_store(tmp_path, records, tokenizer_file))
    with pytest.warns(UserWarning, match="1 train example"):
        dataset = build_preference_datasets([prefix], 6, {"train": 1}, seed=0, split="1")["train"]
    store = dataset.stores[0]
    assert dataset.examples.tolist() == [[0, 0]]
    input_ids, labels, last_index = store.row(0, 6)  # 12 tokens -> the last 6: t5 t6 <|end|> <|assistant|> t7 t8 <|end|>
    full = store.store.document(0).tolist()
    assert input_ids.tolist() == full[-6:] and last_index == 5
    assert labels.tolist() == [IGNORE_INDEX, IGNORE_INDEX] + full[-3:] + [IGNORE_INDEX]
    with pytest.raises(DataError, match="no train examples"), pytest.warns(UserWarning):
        build_preference_datasets([prefix], 3, {"train": 1}, seed=0, split="1")


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "t1", "chosen": "t2"}', "needs 'chosen' and 'rejected'"),
    ('{"chosen": "t2", "rejected": "t3"}', "a pair needs its context: 'prompt' \\(a string or messages\\)"),
    ('{"prompt": "t1", "chosen": {"role": "user", "content": "t2"}, "rejected": "t3"}', "'chosen' must be the reply"),
    ('{"messages": [{"role": "user", "content": "t1"}], "scores": {"a": 1}}', "ending with the assistant reply"),
    ('{"messages": [{"role": "user", "content": "t1"}, {"role": "assistant", "content": "t2"}], "scores": {"a": "x"}}',
     "'scores' must be an object of numbers"),
    ("not json", "not valid JSON"),
])
def test_bad_lines_are_refused_naming_the_file_and_line(tmp_path, tokenizer_file, line, message, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(PAIRS[0]) + "\n" + line + "\n")
    with pytest.raises(DataError, match=f"bad.jsonl, line 2.*{message}"):
        preprocess_preference([path], tokenizer_file, tmp_path / "s", max_vocab_size=128)
    assert main(["preprocess", "--preference", "--input", str(path), "--tokenizer", str(tokenizer_file),
                 "--out", str(tmp_path / "s")]) == 2
    error = capsys.readouterr().err.strip()
    assert "bad.jsonl, line 2" in error and len(error.splitlines()) == 1
    assert not (tmp_path / "s.bin").exists()  # nothing half-written


def test_pairs_and_rated_replies_are_not_mixed(tmp_path, tokenizer_file):
    rated = {"messages": [{"role": "user", "content": "t1"}, {"role": "assistant", "content": "t2"}],
             "scores": {"a": 1}}
    with pytest.raises(DataError, match="line 2: a score example after pairs"):
        write_store(tmp_path, [PAIRS[0], rated], tokenizer_file)


def test_a_pairs_tools_are_in_both_conversations_prompts(tmp_path, tokenizer_file):
    """``tools`` beside a pair (as in SFT records): rendered into the prompt of both replies, untrained."""
    from meshlm.data.chat import TOOLS_INTRODUCTION

    tools = [{"type": "function", "function": {"name": "t7"}}]
    line = {"prompt": [{"role": "user", "content": "t1 t2"}], "chosen": [{"role": "assistant", "content": "t3"}],
            "rejected": [{"role": "assistant", "content": "t5"}], "tools": tools}
    assert main(["preprocess", "--preference", "--input", str(write_jsonl(tmp_path / "p.jsonl", [line])),
                 "--tokenizer", str(tokenizer_file), "--out", str(tmp_path / "prefs"), "--max-vocab-size", "128"]) == 0
    store = PreferenceStore(tmp_path / "prefs")
    tokenizer = load_tokenizer(tmp_path / "prefs.tokenizer" / "tokenizer.json")
    context = f'<|system|>\n{TOOLS_INTRODUCTION}\n{{"name":"t7"}}<|end|>\n<|user|>\nt1 t2<|end|>\n<|assistant|>\n'
    for document, reply in enumerate(("t3<|end|>", "t5<|end|>")):
        context_ids, reply_ids = ids_of(tokenizer, context), ids_of(tokenizer, reply)
        start, stop = store.store.offsets[document], store.store.offsets[document + 1]
        assert store.store.document(document).tolist() == context_ids + reply_ids
        assert store.store.loss_mask[start:stop].tolist() == [0] * len(context_ids) + [1] * len(reply_ids)
