"""meshlm/data/preference_formats.py: TRL's conversational pairs and UltraFeedback's whole
conversations read as the same two conversations as meshlm's own shape, and stores alike."""

from __future__ import annotations

import json

import pytest

from meshlm.data.indexed import TokenStore
from meshlm.data.preference import preprocess_preference
from meshlm.data.preference_formats import pair_conversations
from meshlm.errors import DataError
from tests.helpers.counting_corpus import write_corpus

USER = {"role": "user", "content": "t1 t2"}
CHOSEN, REJECTED = {"role": "assistant", "content": "t3 t4"}, {"role": "assistant", "content": "t5"}
EXPECTED = {"chosen": [USER, CHOSEN], "rejected": [USER, REJECTED]}
SHAPES = {
    "meshlm": {"prompt": "t1 t2", "chosen": "t3 t4", "rejected": "t5"},
    "trl conversational": {"prompt": [USER], "chosen": [CHOSEN], "rejected": [REJECTED]},
    "trl implicit prompt": {"chosen": [USER, CHOSEN], "rejected": [USER, REJECTED]},
    "ultrafeedback": {"prompt": "t1 t2", "prompt_id": "x", "chosen": [USER, CHOSEN], "rejected": [USER, REJECTED],
                      "score_chosen": 8.0, "score_rejected": 4.0},
    "messages context": {"messages": [USER], "chosen": CHOSEN, "rejected": "t5"},
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_shape_reads_as_the_same_pair(shape):
    assert pair_conversations(SHAPES[shape], "x") == EXPECTED


def test_their_stores_are_the_same_bytes(tmp_path):
    tokenizer = write_corpus(tmp_path / "corpus", num_documents=4).parent / "tokenizer.json"
    for name, records in (("own", [SHAPES["meshlm"]] * 3), ("mixed", [SHAPES[shape] for shape in sorted(SHAPES)])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
        preprocess_preference([tmp_path / f"{name}.jsonl"], tokenizer, tmp_path / name, max_vocab_size=128)
    own, mixed = TokenStore(tmp_path / "own"), TokenStore(tmp_path / "mixed")
    assert len(mixed) == 2 * len(SHAPES)
    for document in range(len(mixed)):
        assert mixed.document(document).tolist() == own.document(document % 2).tolist()


@pytest.mark.parametrize("record, message", [
    ({"prompt": "t1", "chosen": [{"role": "user", "content": "t9"}, CHOSEN], "rejected": "t5"},
     "'chosen' is a whole conversation that does not start with the record's prompt/messages"),
    ({"chosen": [USER, CHOSEN], "rejected": [{"role": "user", "content": "t7"}, REJECTED]},
     "'chosen' and 'rejected' start differently"),
    ({"chosen": "t3", "rejected": "t5"}, "a pair needs its context"),
    ({"prompt": 3, "chosen": "t3", "rejected": "t5"}, "'prompt' must be a string or a list of messages"),
    ({"prompt": "t1", "chosen": {"role": "user", "content": "t3"}, "rejected": "t5"}, "'chosen' must be the reply"),
])
def test_pairs_that_are_not_two_replies_to_one_prompt_are_refused(record, message):
    with pytest.raises(DataError, match=message):
        pair_conversations(record, "x")
