"""``meshlm tokenizer extend``: the extended tokenizer keeps every old id and special token, encodes
text without the new merges exactly as before (and any text, once its new tokens are expanded back
to their base pieces), encodes domain text in fewer tokens, and refuses what it cannot extend with
one sentence."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import tokenizers

from meshlm.cli import main
from meshlm.data.tokenizer import load_tokenizer
from meshlm.data.tokenizer_extension import base_pieces, extend_tokenizer

IDENTIFIERS = ["isinstance", "tensor_parallel", "gradient", "optimizer", "self.weight", "torch.zeros",
               "hidden_states", "attention_mask", "micro_batch", "checkpoint"]
GENERAL = ["Shall I compare thee to a summer's day?", "The quick brown fox jumps over the lazy dog.",
           "short", "Thou art more lovely and more temperate."]


def domain_documents(count: int, seed: int) -> list[str]:
    """Python-like documents built from a few identifiers, in random combinations."""
    rng = random.Random(seed)
    documents = []
    for _ in range(count):
        a, b, c = (rng.choice(IDENTIFIERS) for _ in range(3))
        documents.append(f"def update_{a.split('.')[-1]}({b}, {c}):\n    if isinstance({b}, {c}):\n"
                         f"        return {a}({b}) + {rng.randint(0, 99)}\n    return {c}\n")
    return documents


@pytest.fixture(scope="module")
def extended(tmp_path_factory, tokenizer_path) -> tuple[Path, Path]:
    directory = tmp_path_factory.mktemp("extended")
    corpus = directory / "domain.jsonl"
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in domain_documents(300, seed=0)))
    extension = extend_tokenizer(tokenizer_path, [corpus], 40, directory / "new" / "tokenizer.json")
    assert len(extension.new_tokens) == 40 and extension.out == directory / "new" / "tokenizer.json"
    return tokenizer_path, extension.out


def backends(extended) -> tuple[tokenizers.Tokenizer, tokenizers.Tokenizer]:
    return tuple(tokenizers.Tokenizer.from_file(str(path)) for path in extended)


def test_every_old_id_and_special_token_is_kept(extended):
    base, new = backends(extended)
    old_vocab, new_vocab = base.get_vocab(with_added_tokens=True), new.get_vocab(with_added_tokens=True)
    assert all(new_vocab[token] == token_id for token, token_id in old_vocab.items())
    added = sorted(set(new_vocab.values()) - set(old_vocab.values()))
    assert added == list(range(300, 340)) and new.get_vocab_size(with_added_tokens=True) == 340
    assert base.get_added_tokens_decoder() == new.get_added_tokens_decoder()  # specials: same ids, still special
    old_loaded, new_loaded = load_tokenizer(extended[0]), load_tokenizer(extended[1])
    assert (new_loaded.bos_token_id, new_loaded.eos_token_id, new_loaded.pad_token_id) == (0, 1, 2) == \
        (old_loaded.bos_token_id, old_loaded.eos_token_id, old_loaded.pad_token_id)
    assert (extended[1].parent / "tokenizer_config.json").is_file()


def test_old_text_encodes_as_before(extended):
    """Expanding each new token into its base pieces gives the base encoding of any text; text in
    which no new merge applies (general English here) keeps its ids exactly."""
    base, new = backends(extended)
    pieces = base_pieces(base, new)
    assert len(pieces) == 40 and all(len(ids) >= 2 for ids in pieces.values())
    for text in GENERAL + domain_documents(20, seed=1):
        new_ids = new.encode(text).ids
        expanded = [piece for token in new_ids for piece in pieces.get(token, [token])]
        assert expanded == base.encode(text).ids, text
    for text in GENERAL:
        assert new.encode(text).ids == base.encode(text).ids, text
    assert new.encode("<|bos|>Thou art<|eos|>").ids == base.encode("<|bos|>Thou art<|eos|>").ids


def test_domain_text_gets_fewer_tokens(extended):
    base, new = backends(extended)
    held_out = domain_documents(50, seed=2)  # not the text the tokens were learned on
    base_count = sum(len(base.encode(text).ids) for text in held_out)
    new_encodings = [new.encode(text).ids for text in held_out]
    new_count = sum(map(len, new_encodings))
    assert new_count < 0.7 * base_count, (new_count, base_count)
    assert {token for ids in new_encodings for token in ids if token >= 300}  # the new tokens are used
    assert all(new.decode(ids) == text for ids, text in zip(new_encodings, held_out))  # lossless
    isinstance_ids = new.encode(" isinstance").ids
    assert len(isinstance_ids) < len(base.encode(" isinstance").ids) and max(isinstance_ids) >= 300


def test_cli_extends_and_keeps_tokenizer_train(tmp_path, tokenizer_path, capsys):
    corpus = tmp_path / "domain.jsonl"
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in domain_documents(100, seed=3)))
    assert main(["tokenizer", "extend", str(tokenizer_path), "--input", str(corpus), "--add", "12",
                 "--out", str(tmp_path / "new")]) == 0
    printed = capsys.readouterr().out
    assert "300 base ids kept, 12 new tokens, ids 300..311" in printed and "meshlm adapt-vocab" in printed
    assert load_tokenizer(tmp_path / "new" / "tokenizer.json").vocab_size == 312
    assert sorted(path.name for path in (tmp_path / "new").iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    assert main(["tokenizer", "train", "--input", str(corpus), "--vocab-size", "280",
                 "--out", str(tmp_path / "trained.json")]) == 0
    assert load_tokenizer(tmp_path / "trained.json").vocab_size == 280


def word_level_tokenizer(path: Path) -> Path:
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tokenizer.save(str(path))
    return path


@pytest.mark.parametrize("case, words", [
    ("tiktoken", "a tiktoken tokenizer; `meshlm tokenizer extend` extends Hugging Face tokenizer.json files"),
    ("word-level", "its model is WordLevel, not BPE"),
    ("empty", "no documents"),
    ("add-0", "--add 0: the number of new tokens must be at least 1"),
    ("onto-base", "is the base tokenizer itself"),
])
def test_refusals_are_one_sentence(tmp_path, tokenizer_path, capsys, case, words):
    corpus = tmp_path / "domain.jsonl"
    corpus.write_text(json.dumps({"text": "def f(x): return x"}) + "\n")
    base, add, out = str(tokenizer_path), "5", str(tmp_path / "out.json")
    if case == "tiktoken":
        base = str(tmp_path / "cl.tiktoken")
        Path(base).write_text("YQ== 0\n")
    elif case == "word-level":
        base = str(word_level_tokenizer(tmp_path / "tokenizer.json"))
    elif case == "empty":
        corpus.write_text("\n\n")
        corpus = corpus.rename(tmp_path / "empty.txt")
    elif case == "add-0":
        add = "0"
    else:
        out = base
    before = Path(tokenizer_path).read_bytes()
    code = main(["tokenizer", "extend", base, "--input", str(corpus), "--add", add, "--out", out])
    error = capsys.readouterr().err.strip()
    assert code == 2 and words in error and len(error.splitlines()) == 1, error
    assert Path(tokenizer_path).read_bytes() == before and not (tmp_path / "out.json").exists()
