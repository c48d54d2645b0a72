"""A run's tokenizer goes into its checkpoints under the name of its format (``copy_tokenizer``),
so that ``load_tokenizer`` reads it back, whichever format it is."""

from __future__ import annotations

import base64
import json

import pytest
import tokenizers

from meshlm.checkpoint.files import copy_tokenizer, copy_tokenizer_files
from meshlm.data.tokenizer import TiktokenTokenizer, load_tokenizer


def test_a_huggingface_tokenizer_is_copied_as_tokenizer_json_with_its_special_tokens(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "b": 1, "<eos>": 2}, unk_token="<eos>"))
    backend.save(str(source / "words.json"))
    (source / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    (tmp_path / "checkpoint").mkdir()
    copy_tokenizer(source / "words.json", tmp_path / "checkpoint")
    assert sorted(path.name for path in (tmp_path / "checkpoint").iterdir()) == ["tokenizer.json",
                                                                                 "tokenizer_config.json"]
    assert load_tokenizer(tmp_path / "checkpoint").eos_token_id == 2


def test_a_tiktoken_file_named_tokenizer_model_is_copied_as_tiktoken(tmp_path):
    pytest.importorskip("tiktoken")
    source = tmp_path / "llama3"  # Llama 3 ships its tiktoken ranks as a text tokenizer.model
    source.mkdir()
    ranks = [bytes([value]) for value in range(256)] + [b"th", b"the"]
    (source / "tokenizer.model").write_text("".join(f"{base64.b64encode(token).decode()} {rank}\n"
                                                    for rank, token in enumerate(ranks)))
    checkpoint, exported = tmp_path / "checkpoint", tmp_path / "exported"
    checkpoint.mkdir()
    exported.mkdir()
    copy_tokenizer(source / "tokenizer.model", checkpoint)
    assert [path.name for path in checkpoint.iterdir()] == ["tokenizer.tiktoken"]
    tokenizer = load_tokenizer(checkpoint)
    assert isinstance(tokenizer, TiktokenTokenizer) and tokenizer.encode("the") == [257]
    assert copy_tokenizer_files(checkpoint, exported) == ["tokenizer.tiktoken"]  # and on to a saved model
