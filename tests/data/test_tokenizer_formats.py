"""SentencePiece and tiktoken files behind the same ``load_tokenizer`` interface."""

import base64
import io
import json
import sys

import pytest

from meshlm.data.indexed import TokenStore
from meshlm.data.preprocess import preprocess
from meshlm.data.tokenizer import SentencePieceTokenizer, TiktokenTokenizer, load_tokenizer
from meshlm.errors import DataError

SENTENCES = ["the cat sat on the mat.", "a dog sat on a log.", "the cat and the dog are friends."] * 20


def write_sentencepiece_model(directory, name="tokenizer.model"):
    sentencepiece = pytest.importorskip("sentencepiece")
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(SENTENCES), model_writer=model, vocab_size=300,
                                             model_type="bpe", byte_fallback=True, pad_id=3, minloglevel=2,
                                             hard_vocab_limit=False)
    (directory / name).write_bytes(model.getvalue())
    return sentencepiece.SentencePieceProcessor(model_file=str(directory / name))


def write_tiktoken_ranks(path, merges=(b"th", b"the", b" t", b" the")):
    """Every single byte (ranks 0-255), then the given merges."""
    tokens = [bytes([value]) for value in range(256)] + list(merges)
    path.write_text("".join(f"{base64.b64encode(token).decode()} {rank}\n" for rank, token in enumerate(tokens)))
    return path


def test_sentencepiece_model_encodes_like_the_library_and_adds_bos(tmp_path):
    processor = write_sentencepiece_model(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    assert isinstance(tokenizer, SentencePieceTokenizer) and tokenizer.vocab_size == 300
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 3)
    text = "the cat sat on a log 🙂"
    plain = tokenizer.encode(text, add_special_tokens=False)
    assert plain == processor.encode(text) and tokenizer.encode(text) == [1] + plain
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.decode([1] + plain + [2], skip_special_tokens=False) == f"<s>{text}</s>"
    assert tokenizer.encode_batch(["a dog", "the mat"]) == [tokenizer.encode("a dog"), tokenizer.encode("the mat")]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False, "eos_token": "<pad>"}))
    configured = load_tokenizer(tmp_path / "tokenizer.model")
    assert configured.encode(text) == plain and configured.eos_token_id == 3


def test_preprocess_reads_a_sentencepiece_tokenizer(tmp_path):
    write_sentencepiece_model(tmp_path)
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in SENTENCES[:3]))
    preprocess([tmp_path / "a.jsonl"], tmp_path / "tokenizer.model", tmp_path / "out", append_eos=True,
               show_progress=False)
    tokenizer = load_tokenizer(tmp_path)
    store = TokenStore(tmp_path / "out")
    assert [store.document(index).tolist() for index in range(3)] == [
        tokenizer.encode(text, add_special_tokens=False) + [2] for text in SENTENCES[:3]]


def test_tiktoken_ranks_file_with_special_tokens_from_the_config(tmp_path):
    pytest.importorskip("tiktoken")
    write_tiktoken_ranks(tmp_path / "tokenizer.tiktoken")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|endoftext|>",
         "added_tokens_decoder": {"300": {"content": "<|pad|>"}}, "pad_token": "<|pad|>"}))
    tokenizer = load_tokenizer(tmp_path)
    assert isinstance(tokenizer, TiktokenTokenizer)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (301, 302, 300)
    assert tokenizer.vocab_size == 303
    assert tokenizer.encode("the the") == [257, 259]  # merges applied inside the pre-tokenized words
    assert tokenizer.encode("x<|endoftext|>") == [ord("x"), 302]
    assert tokenizer.decode([257, 259, 302]) == "the the"
    assert tokenizer.decode([257, 302], skip_special_tokens=False) == "the<|endoftext|>"
    assert tokenizer.encode_batch(["the", "Ünï"]) == [[257], list("Ünï".encode())]
    assert tokenizer.decode(tokenizer.encode("Ünïcödé 🙂")) == "Ünïcödé 🙂"


def test_a_text_tokenizer_model_is_read_as_tiktoken(tmp_path):
    pytest.importorskip("tiktoken")
    write_tiktoken_ranks(tmp_path / "tokenizer.model")  # Llama 3 ships its tiktoken ranks under this name
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True, "bos_token": "<|bos|>"}))
    tokenizer = load_tokenizer(tmp_path)
    assert isinstance(tokenizer, TiktokenTokenizer) and tokenizer.encode("the") == [260, 257]


def test_missing_optional_packages_say_what_to_install(tmp_path, monkeypatch):
    (tmp_path / "a.model").write_bytes(b"\n\x0e\n\x05<unk>")
    write_tiktoken_ranks(tmp_path / "b.tiktoken")
    monkeypatch.setitem(sys.modules, "sentencepiece", None)
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    with pytest.raises(DataError, match=r"a\.model: .*pip install sentencepiece"):
        load_tokenizer(tmp_path / "a.model")
    with pytest.raises(DataError, match=r"b\.tiktoken: .*pip install tiktoken"):
        load_tokenizer(tmp_path / "b.tiktoken")


def test_corrupt_files_name_the_file(tmp_path):
    pytest.importorskip("sentencepiece")
    pytest.importorskip("tiktoken")
    (tmp_path / "broken.model").write_bytes(b"\x00\x01 definitely not a model")
    with pytest.raises(DataError, match=r"broken\.model: not a readable SentencePiece model"):
        load_tokenizer(tmp_path / "broken.model")
    (tmp_path / "broken.tiktoken").write_text("dGhl 0\nnot base64!! x\n")
    with pytest.raises(DataError, match=r"broken\.tiktoken, line 2: expected 'BASE64TOKEN RANK'"):
        load_tokenizer(tmp_path / "broken.tiktoken")


def tokenizer_of_kind(kind: str, folder):
    """A small tokenizer of one format written into ``folder`` and loaded (the tiktoken package skips
    its kind where it is missing)."""
    if kind == "tiktoken":
        pytest.importorskip("tiktoken")
        write_tiktoken_ranks(folder / "tokenizer.tiktoken")
    elif kind.startswith("sentencepiece"):
        write_sentencepiece_model(folder)
    else:
        from tests.helpers.generation_model import write_sentence_tokenizer

        write_sentence_tokenizer(folder / "hf")
        folder = folder / "hf"
    return load_tokenizer(folder)


@pytest.mark.parametrize("kind", ["huggingface byte-level", "sentencepiece byte fallback", "tiktoken"])
def test_token_bytes_join_to_the_text_also_inside_utf8_characters(kind, tmp_path):
    """``token_bytes`` of each token of a text with characters the vocabulary splits into bytes
    joins to the text's UTF-8 bytes, where decoding a lone token would give U+FFFD."""
    tokenizer = tokenizer_of_kind(kind, tmp_path)
    text = "the cat sat on a log, Ünïcödé 🙂"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.token_bytes(token) for token in ids]
    assert b"".join(pieces).decode("utf-8").strip() == text  # (SentencePiece marks the first word with a space)
    assert any(len(piece) == 1 and piece[0] >= 0x80 for piece in pieces)  # a lone byte of a character
    if tokenizer.eos_token_id is not None and kind != "sentencepiece byte fallback":
        assert tokenizer.token_bytes(tokenizer.eos_token_id).decode() in ("<|endoftext|>", "</s>")


@pytest.mark.parametrize("kind", ["huggingface byte-level", "sentencepiece byte fallback", "tiktoken"])
def test_text_tokens_are_every_ids_bytes_with_the_special_tokens_left_out(kind, tmp_path):
    """``text_tokens`` (what constrained decoding may draw as text) is ``token_bytes`` of every id but
    the special ones -- eos, SentencePiece's control pieces, tiktoken's specials -- which are None."""
    if kind == "tiktoken":
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>"}))
    tokenizer = tokenizer_of_kind(kind, tmp_path)
    spelt = tokenizer.text_tokens()
    assert len(spelt) == tokenizer.vocab_size and tokenizer.eos_token_id is not None
    assert spelt[tokenizer.eos_token_id] is None
    text = [token for token, data in enumerate(spelt) if data is not None]
    assert len(text) >= tokenizer.vocab_size - 4
    assert all(spelt[token] == tokenizer.token_bytes(token) for token in text)
    ids = tokenizer.encode("the cat sat", add_special_tokens=False)
    assert b"".join(spelt[token] for token in ids).strip() == b"the cat sat"
