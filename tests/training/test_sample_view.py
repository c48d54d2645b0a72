"""``meshlm data show`` (meshlm/training/sample_view.py): the samples shown are the trainer's, bit for
bit, with the documents they pack and the tokens the loss counts marked."""

from __future__ import annotations

import json

import pytest

from meshlm.cli import main
from meshlm.config import load_run_config
from meshlm.data.chat_preprocess import preprocess_chat
from meshlm.data.indexed import TokenStore
from meshlm.training.data_loading import build_training_data
from meshlm.training.sample_view import DIM, RowView, render_row, view_samples
from tests.helpers.preference_data import CHOSEN_MARKER, REJECTED_MARKER, separable_pairs, write_store


@pytest.mark.parametrize("boundaries", [False, True])
def test_the_samples_are_the_trainers_with_their_documents_and_counted_labels(make_config, boundaries):
    config = make_config("train.seq_len=64", f"data.document_boundaries={str(boundaries).lower()}")
    dataset = build_training_data(config).train
    samples, tokenizer = view_samples(config, "train", 3, 4)
    assert [sample.index for sample in samples] == [3, 4, 5, 6] and tokenizer is not None
    store = TokenStore(config.data.blend.replace("blend.json", "corpus"))
    starts_seen = 0
    for sample in samples:
        row, = sample.rows
        item = dataset[sample.index]
        assert row.tokens[:-1] == item["input_ids"].tolist() and len(row.tokens) == 65
        labels = item["labels"].tolist()
        assert [label != -100 for label in labels] == row.counted[1:] and not row.counted[0]
        assert all(token == label for token, label, counted in zip(row.tokens[1:], labels, row.counted[1:]) if counted)
        for position, document in row.document_starts.items():  # a document of the store begins there
            first = int(store.offsets[document])
            assert row.tokens[position:position + 3] == store.tokens[first:first + 3].tolist()
            assert row.counted[position] is (not boundaries)  # across a boundary the label is ignored
            starts_seen += 1
            assert f"<|endoftext|>⟦document {document}⟧" in render_row(row, tokenizer, color=False).replace("«", "") \
                .replace("»", "")  # special tokens are shown: the EOS that ends the document before
        assert sample.source.startswith(f"{store.prefix}, document")
    assert starts_seen > 0  # 64-token samples of 20-80-token documents cross boundaries
    if not boundaries:
        assert all(all(row.counted[1:]) for sample in samples for row in sample.rows)


def test_the_command_prints_a_steps_samples_and_json_for_scripts(make_config, corpus_blend, tmp_path, capsys):
    overrides = [f"data.blend={corpus_blend}", "train.seq_len=16", "train.global_batch_size=4",
                 "model.vocab_size=64", f"train.run_dir={tmp_path / 'run'}"]
    assert main(["data", "show", *overrides, "--step", "2", "--count", "2"]) == 0
    out = capsys.readouterr().out
    headers = [line for line in out.splitlines() if line.startswith("── sample")]
    assert [header.split(" · ")[0] for header in headers] == ["── sample 8 (step 2, sample 0 of its 4)",
                                                              "── sample 9 (step 2, sample 1 of its 4)"]
    assert all(header.endswith("17 tokens, 16 counted by the loss") for header in headers)
    assert "«t" in out and "\x1b[" not in out  # not a terminal: the first token between « », no colour codes
    assert main(["data", "show", *overrides, "--sample", "1", "--count", "1", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    expected, _ = view_samples(load_run_config(None, overrides), "train", 1, 1)
    assert record["index"] == 1 and record["rows"][0]["tokens"] == expected[0].rows[0].tokens
    assert record["rows"][0]["text"].split()[0].startswith("t")


def test_a_chat_store_shows_only_the_assistant_turns_as_counted(make_config, corpus_blend, tmp_path, capsys):
    chats = [{"messages": [{"role": "user", "content": "t1 t2"}, {"role": "assistant", "content": "t4 t5 t6"}]}] * 30
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(chat) + "\n" for chat in chats))
    preprocess_chat([tmp_path / "chats.jsonl"], corpus_blend.parent / "tokenizer.json", tmp_path / "sft",
                    max_vocab_size=128)
    overrides = ["model.vocab_size=128", f"data.prefixes=[{tmp_path / 'sft'}]", "data.blend=null",
                 "train.seq_len=64", "--count", "1", "--no-color"]
    assert main(["data", "show", *overrides]) == 0
    text = capsys.readouterr().out.split("\n", 1)[1]
    counted = "".join(piece.split("»", 1)[-1] for piece in text.split("«"))  # the text outside « »
    assert "t4 t5 t6" in counted and "t1" not in counted and "<|user|>" not in counted
    assert main(["data", "show", *overrides[:-1], "--json"]) == 0
    captured = capsys.readouterr()
    json.loads(captured.out)  # stdout is the JSON alone; the chat-store note goes to stderr
    assert "chat store" in captured.err


def test_preference_pairs_show_both_rows_with_the_replies_counted(make_config, corpus_blend, tmp_path, capsys):
    pairs = write_store(tmp_path, separable_pairs(20, seed=0), corpus_blend.parent / "tokenizer.json", "pairs")
    assert main(["data", "show", "model.vocab_size=128", f"data.prefixes=[{pairs}]", "data.blend=null",
                 "train.objective=reward", "model.head=reward", "train.seq_len=32", "data.split=80,20,0",
                 "--count", "1"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("── sample 0 (step 0, sample 0 of its") and f"{pairs}, example" in lines[0]
    assert lines[1] == "[chosen]" and lines[3] == "[rejected]"
    assert CHOSEN_MARKER in lines[2].rsplit("»", 1)[-1] and REJECTED_MARKER in lines[4].rsplit("»", 1)[-1]


def test_colour_dims_what_is_not_counted():
    row = RowView(tokens=[1, 2, 3, 4], counted=[False, True, True, False], document_starts={2: 7})
    class Spaced:
        @staticmethod
        def decode(ids, skip_special_tokens=True):
            assert not skip_special_tokens  # an EOS between documents must show
            return "".join(f"<{token}>" for token in ids)
    assert render_row(row, Spaced, color=False) == "«<1>»<2>⟦document 7⟧<3>«<4>»"
    coloured = render_row(row, Spaced, color=True)
    assert f"{DIM}<1>" in coloured and f"{DIM}<4>" in coloured and "⟦document 7⟧" in coloured
    assert render_row(row, None, color=False) == "«1»2⟦document 7⟧3«4»"  # no tokenizer: the ids


@pytest.mark.parametrize("arguments, message", [
    (["train.eval_every=0", "--split", "valid"], "the run has no validation samples"),
    (["--step", "1000"], r"sample 4,000 is outside the train split's 16 samples"),
    (["--count", "0"], "--count 0 must be at least 1"),
    (["--step", "-1"], "--step -1 must be >= 0"),
])
def test_bad_requests_are_refused_in_one_sentence(corpus_blend, tmp_path, capsys, arguments, message):
    base = [f"data.blend={corpus_blend}", "model.vocab_size=64", "train.steps=4", "train.global_batch_size=4",
            "train.seq_len=16"]
    assert main(["data", "show", *base, *arguments]) == 2
    assert re_search(message, capsys.readouterr().err)


def re_search(pattern: str, text: str) -> bool:
    import re
    return re.search(pattern, text) is not None
