import json

import pytest

from meshlm.data.readers import expand_inputs, read_all_documents, read_documents
from meshlm.errors import DataError


def test_jsonl_yields_the_text_key_and_skips_blank_lines(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"body": "first"}) + "\n\n" + json.dumps({"body": "second\nline"}) + "\n")
    assert list(read_documents(path, text_key="body")) == ["first", "second\nline"]


def test_txt_documents_are_blank_line_separated_blocks(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("para one\nstill one\n\n\n  \npara two\n\nthree")
    assert list(read_documents(path)) == ["para one\nstill one", "para two", "three"]


def test_parquet_column_is_read_in_batches(tmp_path):
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as parquet
    texts = [f"row {index}" for index in range(2500)]  # more than one reader batch
    parquet.write_table(pyarrow.table({"content": texts, "n": list(range(2500))}), tmp_path / "a.parquet")
    seen_bytes = []
    assert list(read_documents(tmp_path / "a.parquet", "content", seen_bytes.append)) == texts
    assert len(seen_bytes) == 3 and sum(seen_bytes) <= (tmp_path / "a.parquet").stat().st_size


def test_missing_key_names_the_key_the_file_the_line_and_the_keys_there(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"content": "x", "meta": 1}) + "\n")
    with pytest.raises(DataError) as caught:
        list(read_documents(path))
    message = str(caught.value)
    assert str(path) in message and "line 2" in message and "'text'" in message
    assert "'content'" in message and "'meta'" in message


def test_missing_parquet_column_names_the_columns(tmp_path):
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as parquet
    parquet.write_table(pyarrow.table({"content": ["a"]}), tmp_path / "a.parquet")
    with pytest.raises(DataError, match=r"a\.parquet.*'text'.*'content'"):
        list(read_documents(tmp_path / "a.parquet"))


@pytest.mark.parametrize("line, problem", [("{not json", "not valid JSON"), ("[1, 2]", "expected a JSON object"),
                                           ('{"text": 5}', "not a string")])
def test_bad_jsonl_lines_name_the_file_and_line(tmp_path, line, problem):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n" + line + "\n")
    with pytest.raises(DataError, match=rf"bad\.jsonl, line 2: {problem}|bad\.jsonl, line 2: .*{problem}"):
        list(read_documents(path))


def test_unreadable_and_undecodable_files_name_the_file(tmp_path):
    directory_named_jsonl = tmp_path / "folder.jsonl"
    directory_named_jsonl.mkdir()
    with pytest.raises(DataError, match="folder.jsonl: cannot read"):
        list(read_documents(directory_named_jsonl))
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1\.txt, line 1: not UTF-8"):
        list(read_documents(latin1))


def test_missing_pyarrow_gives_an_install_hint(tmp_path, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "pyarrow.parquet", None)  # import now raises ImportError
    (tmp_path / "a.parquet").write_bytes(b"PAR1")
    with pytest.raises(DataError, match=r"a\.parquet: .*pip install pyarrow"):
        list(read_documents(tmp_path / "a.parquet"))


def test_expand_inputs_searches_directories_in_sorted_order_and_rejects_the_rest(tmp_path):
    (tmp_path / "b").mkdir()
    for name in ("b/2.txt", "b/1.jsonl", "b/skip.csv"):
        (tmp_path / name).write_text("x")
    assert expand_inputs([tmp_path / "b"]) == [tmp_path / "b/1.jsonl", tmp_path / "b/2.txt"]
    with pytest.raises(DataError, match="no such input"):
        expand_inputs([tmp_path / "missing.jsonl"])
    with pytest.raises(DataError, match=r"skip\.csv: unsupported input type '\.csv'"):
        expand_inputs([tmp_path / "b/skip.csv"])
    assert list(read_all_documents(expand_inputs([tmp_path / "b/2.txt", tmp_path / "b/2.txt"]))) == ["x", "x"]


def test_txt_documents_file_keeps_the_whole_file_as_one_document(tmp_path):
    path = tmp_path / "module.txt"
    path.write_text("def one():\n    return 1\n\n\ndef two():\n    return 2\n")
    assert list(read_documents(path)) == ["def one():\n    return 1", "def two():\n    return 2"]  # the default
    assert list(read_documents(path, txt_documents="paragraph")) == list(read_documents(path))
    whole = "def one():\n    return 1\n\n\ndef two():\n    return 2"
    assert list(read_documents(path, txt_documents="file")) == [whole]
    single = tmp_path / "single.txt"
    single.write_text("one block\nno blank line\n")  # no blank line: both modes read the same document
    assert list(read_documents(single, txt_documents="file")) == list(read_documents(single)) == [
        "one block\nno blank line"]
    assert list(read_all_documents([path, single], txt_documents="file")) == [whole, "one block\nno blank line"]
    with pytest.raises(DataError, match="--txt-documents 'lines' is not a way.*paragraph, file"):
        list(read_documents(path, txt_documents="lines"))


@pytest.mark.parametrize("name, content, txt_documents, message", [
    ("blank.txt", "\n  \n\n", "paragraph", r"blank\.txt: no documents in this file"),
    ("blank.txt", "\n  \n\n", "file", r"blank\.txt: no documents in this file"),
    ("blank.jsonl", "\n\n", "paragraph", r"blank\.jsonl: no documents in this file"),
    ("empty_texts.jsonl", '{"text": ""}\n{"text": ""}\n', "paragraph",
     r"empty_texts\.jsonl: all 2 documents are empty strings under 'text', so there is nothing to tokenize; "
     r"check --text-key"),
])
def test_a_file_without_text_is_refused_by_name(tmp_path, name, content, txt_documents, message):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DataError, match=message):
        list(read_documents(path, txt_documents=txt_documents))


def test_empty_parquet_and_zero_byte_files_are_refused_by_name(tmp_path):
    (tmp_path / "zero.jsonl").write_bytes(b"")
    with pytest.raises(DataError, match=r"zero\.jsonl: the file is empty \(0 bytes\).*leave it out of --input"):
        expand_inputs([tmp_path / "zero.jsonl"])
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "zero.txt").write_bytes(b"")
    with pytest.raises(DataError, match=r"zero\.txt: the file is empty"):  # found in a directory too
        expand_inputs([tmp_path / "folder"])
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as parquet
    parquet.write_table(pyarrow.table({"text": pyarrow.array([], pyarrow.string())}), tmp_path / "none.parquet")
    with pytest.raises(DataError, match=r"none\.parquet: no documents in this file"):
        list(read_documents(tmp_path / "none.parquet"))


def test_a_hugging_face_save_to_disk_folder_reads_its_arrow_files(tmp_path):
    datasets = pytest.importorskip("datasets")
    texts = [f"row {index}" for index in range(50)]
    datasets.Dataset.from_dict({"content": texts, "n": list(range(50))}).save_to_disk(str(tmp_path / "saved"))
    files = expand_inputs([tmp_path / "saved"])  # its dataset_info.json and state.json are skipped
    assert [path.suffix for path in files] == [".arrow"]
    seen = []
    assert list(read_all_documents(files, "content", seen.append)) == texts
    assert sum(seen) == files[0].stat().st_size


def test_arrow_file_format_batches_and_cells_are_checked(tmp_path):
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.ipc as ipc
    table = pyarrow.table({"text": ["a", "b", None], "n": [1, 2, 3]})
    with pyarrow.OSFile(str(tmp_path / "t.arrow"), "wb") as sink:
        writer = ipc.new_file(sink, table.schema)
        writer.write_table(table.slice(0, 2))
        writer.write_table(table.slice(2))
        writer.close()
    documents = read_documents(tmp_path / "t.arrow")
    assert [next(documents), next(documents)] == ["a", "b"]
    with pytest.raises(DataError, match=r"t\.arrow, row 3: column 'text' holds null, not a string"):
        next(documents)
    with pytest.raises(DataError, match=r"t\.arrow: no column 'body' \(columns here: 'text', 'n'\)"):
        list(read_documents(tmp_path / "t.arrow", "body"))
    (tmp_path / "junk.arrow").write_bytes(b"not arrow at all" * 10)
    with pytest.raises(DataError, match=r"junk\.arrow: cannot read this file as Arrow"):
        list(read_documents(tmp_path / "junk.arrow"))
