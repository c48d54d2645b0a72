from meshlm.cli import main
from meshlm.data.indexed import TokenStoreWriter
from meshlm.data.preprocess import preprocess


def test_inspect_names_the_recorded_tokenizer(tmp_path, tokenizer_path, write_jsonl, capsys):
    preprocess([write_jsonl(tmp_path / "a.jsonl", ["one", "two"])], tokenizer_path, tmp_path / "corpus",
               show_progress=False)
    assert main(["data", "inspect", str(tmp_path / "corpus")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "2 documents" in lines[0] and lines[1].startswith("tokenizer: ") and lines[1].endswith("tokenizer.json")
    with TokenStoreWriter(tmp_path / "bare", 10) as writer:  # a store with no metadata, as older meshlm wrote
        writer.add_document([1, 2])
    assert main(["data", "inspect", str(tmp_path / "bare")]) == 0
    assert "tokenizer: none recorded (set data.tokenizer to train)" in capsys.readouterr().out
