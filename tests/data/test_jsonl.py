"""``meshlm/data/jsonl.py``: JSON Lines and .json files (JSON Lines or one array), each record
named by its line or item, and a file that is neither refused with what it must hold."""

import gzip
import json

import pytest

from meshlm.data.jsonl import json_lines, json_records
from meshlm.data.readers import read_documents
from meshlm.errors import DataError


def test_a_json_array_yields_its_items_named_by_position(tmp_path):
    path = tmp_path / "alpaca.json"
    path.write_text(json.dumps([{"text": "one"}, {"text": "two"}], indent=2))
    assert list(json_records(path)) == [(f"{path}, item 1", {"text": "one"}), (f"{path}, item 2", {"text": "two"})]
    assert list(read_documents(path)) == ["one", "two"]
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())  # saved by an editor with a byte-order mark
    assert list(read_documents(path)) == ["one", "two"]


def test_a_gzipped_json_of_lines_reads_as_c4_ships_it(tmp_path):
    path = tmp_path / "c4-train.00000-of-01024.json.gz"
    path.write_bytes(gzip.compress(b'{"text": "a", "url": "u"}\n{"text": "b", "url": "v"}\n'))
    assert list(read_documents(path)) == ["a", "b"]
    assert [where for where, _ in json_records(path)] == [f"{path}, line 1", f"{path}, line 2"]


def test_a_pretty_printed_object_is_refused_with_what_a_json_file_must_hold(tmp_path):
    path = tmp_path / "one.json"
    path.write_text(json.dumps({"text": "one"}, indent=2))
    with pytest.raises(DataError, match=r"one\.json, line 1: not valid JSON \(.*\); a \.json file must hold JSON Lines "
                                        r"\(one record per line\) or one JSON array of records\."):
        list(json_records(path))


def test_a_broken_array_names_the_line_of_the_mistake(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('[\n  {"text": "one"},\n  {"text": "two",}\n]\n')
    with pytest.raises(DataError, match=r"broken\.json, line 3: not valid JSON \(.*\); the file starts a JSON array"):
        list(json_records(path))


def test_array_items_are_checked_as_lines_are(tmp_path):
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps([{"text": "one"}, ["not", "an", "object"]]))
    with pytest.raises(DataError, match=r"mixed\.json, item 2: expected a JSON object with a 'text' key, found a list"):
        list(read_documents(path))


def test_chat_and_preference_readers_take_json_and_compressed_files_but_not_text(tmp_path):
    chats = [{"messages": [{"role": "user", "content": "hi"}]}]
    (tmp_path / "chats.json").write_text(json.dumps(chats))
    (tmp_path / "chats.jsonl.gz").write_bytes(gzip.compress((json.dumps(chats[0]) + "\n").encode()))
    (tmp_path / "chats.txt").write_text("hi\n")
    records = list(json_lines([tmp_path / "chats.json", tmp_path / "chats.jsonl.gz"], "chat data", "{...}"))
    assert [record for _, record in records] == chats * 2
    with pytest.raises(DataError, match=r"chats\.txt: chat data must be \.jsonl \(or \.json\), one \{\.\.\.\} object"):
        list(json_lines([tmp_path / "chats.txt"], "chat data", "{...}"))
