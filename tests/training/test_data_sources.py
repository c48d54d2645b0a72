"""Where a run's data and tokenizer come from, and the vocabulary checks at start-up
(``meshlm/training/data_loading.py``): prefixes over a blend, the tokenizer a token store
records, a model vocabulary too small or far too large."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest

from meshlm.cli import main
from meshlm.data.blend import Blend
from meshlm.data.indexed import TokenStoreWriter
from meshlm.data.preprocess import preprocess
from meshlm.data.tokenizer_training import train_tokenizer
from meshlm.config import DataConfig
from meshlm.errors import ConfigError, DataError
from meshlm.training.data_loading import check_vocabulary, resolve_blend
from meshlm.training.trainer import Trainer

TEXTS = [f"document {index}: the quick brown fox jumps over the lazy dog {index % 7} times." for index in range(300)]


@pytest.fixture(scope="module")
def text_store(tmp_path_factory):
    """A byte-level BPE tokenizer in ``tokenizer/`` and a token store ``stores/corpus`` preprocessed
    with it (so the store's metadata names it); returns the folder holding both."""
    directory = tmp_path_factory.mktemp("text_store")
    corpus = directory / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in TEXTS))
    train_tokenizer([corpus], vocab_size=300, out=directory / "tokenizer" / "tokenizer.json")
    preprocess([corpus], directory / "tokenizer" / "tokenizer.json", directory / "stores" / "corpus",
               append_eos=True, show_progress=False)
    return directory


def test_prefixes_over_a_blend_warn_naming_both_keys(make_config, corpus_blend):
    prefix = corpus_blend.parent / "corpus"
    with pytest.warns(UserWarning, match=rf"data\.prefixes and data\.blend={corpus_blend} are both set: training "
                                         r"reads data\.prefixes and ignores the blend file; set data\.blend=null"):
        blend = resolve_blend(make_config(f"data.prefixes=[{prefix}]").data)
    assert blend.prefixes == [str(prefix)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # data.blend=null silences it
        assert resolve_blend(make_config(f"data.prefixes=[{prefix}]", "data.blend=null").data).prefixes == [
            str(prefix)]


def test_a_run_from_prefixes_carries_the_stores_tokenizer_and_generates_text(make_config, text_store, tmp_path,
                                                                              capsys):
    run_dir = tmp_path / "prefix-run"
    config = make_config(f"data.prefixes=[{text_store / 'stores' / 'corpus'}]", "data.blend=null",
                         "model.vocab_size=320", "train.steps=2", "optim.warmup_steps=1", "train.eval_every=0",
                         f"train.run_dir={run_dir}")
    assert config.data.tokenizer is None
    Trainer(config).run()
    checkpoint = run_dir / "checkpoints" / "step_2"
    assert (checkpoint / "tokenizer.json").read_bytes() == (text_store / "tokenizer" / "tokenizer.json").read_bytes()
    assert (checkpoint / "tokenizer_config.json").is_file()  # the special tokens came along
    assert main(["generate", str(run_dir), "--prompt", "document 3: the quick", "--max-new-tokens", "4",
                 "--greedy", "--json"]) == 0
    output = json.loads(capsys.readouterr().out.strip())
    assert len(output["ids"]) == 4 and isinstance(output["text"], str)


def test_stores_of_different_tokenizers_are_refused_and_a_lost_tokenizer_warns(text_store, tmp_path):
    corpus = text_store / "corpus.jsonl"
    copy = tmp_path / "copy"  # the same tokenizer in another place: accepted
    shutil.copytree(text_store / "tokenizer", copy)
    preprocess([corpus], copy / "tokenizer.json", tmp_path / "same", show_progress=False)
    ours = str(text_store / "stores" / "corpus")
    both = resolve_blend(DataConfig(blend=None, prefixes=[ours, str(tmp_path / "same")]))
    assert both.tokenizer == str(text_store / "stores" / ".." / "tokenizer" / "tokenizer.json")

    other = train_tokenizer([corpus], vocab_size=280, out=tmp_path / "other" / "tokenizer.json")
    preprocess([corpus], other, tmp_path / "other_store", show_progress=False)
    mixed = DataConfig(blend=None, prefixes=[ours, str(tmp_path / "other_store")])
    with pytest.raises(DataError, match=r"data\.prefixes: .*corpus was preprocessed with the tokenizer "
                                        r".*tokenizer\.json and .*other_store with .*, which differ.*preprocess every "
                                        r"store with one"):
        resolve_blend(mixed)
    mixed.tokenizer = str(other)  # the user says which one is right
    assert resolve_blend(mixed).tokenizer == str(other)

    shutil.rmtree(tmp_path / "other")
    lost = DataConfig(blend=None, prefixes=[str(tmp_path / "other_store")])
    with pytest.warns(UserWarning, match=r"other_store\.meta\.json names the tokenizer .*which no longer exists.*"
                                         r"set data\.tokenizer"):
        assert resolve_blend(lost).tokenizer is None


def write_store(prefix, vocab_size: int) -> str:
    with TokenStoreWriter(prefix, vocab_size) as writer:
        writer.add_document([1, 2, 3])
    return str(prefix)


def test_a_vocabulary_smaller_than_the_data_is_refused(tmp_path, text_store):
    blend = Blend([write_store(tmp_path / "corpus", 300)], [1.0])
    with pytest.raises(ConfigError, match=r"model\.vocab_size=299 is smaller than the vocabulary of .*corpus\.idx "
                                          r"\(token store\), which has 300 ids; set model\.vocab_size=300"):
        check_vocabulary(blend, 299)
    tokenizer = text_store / "tokenizer" / "tokenizer.json"
    with pytest.raises(ConfigError, match=r"model\.vocab_size=290 .*/tokenizer\.json \(tokenizer\), which has 300"):
        check_vocabulary(Blend([write_store(tmp_path / "small", 10)], [1.0], str(tokenizer)), 290)


@pytest.mark.parametrize("needed, vocab_size, warns", [
    (300, 300, False), (300, 384, False), (300, 600, False), (300, 601, True),  # 2x: fine, beyond: warns
    (50, 128, False), (50, 129, True),  # a small vocabulary may pad up to a multiple of 128
])
def test_a_vocabulary_far_larger_than_the_data_warns(tmp_path, needed, vocab_size, warns):
    blend = Blend([write_store(tmp_path / "corpus", needed)], [1.0])
    if not warns:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            check_vocabulary(blend, vocab_size)
        return
    padded = 384 if needed == 300 else 128
    with pytest.warns(UserWarning, match=rf"model\.vocab_size={vocab_size} is more than twice the {needed} ids of "
                                         rf".*corpus\.idx \(token store\): the other {vocab_size - needed} embedding "
                                         rf"rows are never trained; set model\.vocab_size={padded}"):
        check_vocabulary(blend, vocab_size)
