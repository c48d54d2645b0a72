"""``meshlm tokenizer encode | decode`` (meshlm/data/tokenizer_inspect.py): the ids and pieces are
the tokenizer's own, special tokens stay single, and a bad request is one sentence."""

from __future__ import annotations

import json

from meshlm.cli import main
from meshlm.data.tokenizer import load_tokenizer

TEXT = "Shall I compare thee?<|eos|> Ünïcödé"


def test_encode_prints_the_tokenizers_ids_and_pieces(tokenizer_path, tmp_path, capsys):
    tokenizer = load_tokenizer(tokenizer_path)
    assert main(["tokenizer", "encode", str(tokenizer_path), "--text", TEXT, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["ids"] == tokenizer.encode(TEXT, add_special_tokens=False)
    assert tokenizer.eos_token_id in printed["ids"]  # the special token written in the text stays one token
    assert printed["pieces"] == [tokenizer.decode([token], skip_special_tokens=False) for token in printed["ids"]]
    assert "".join(printed["pieces"]).startswith("Shall I compare thee?<|eos|> ")  # ASCII pieces join back
    assert (printed["tokens"], printed["characters"]) == (len(printed["ids"]), len(TEXT))
    (tmp_path / "prompt.txt").write_text(TEXT, encoding="utf-8")
    assert main(["tokenizer", "encode", str(tokenizer_path.parent), "--file", str(tmp_path / "prompt.txt")]) == 0
    table = capsys.readouterr().out.splitlines()
    assert len(table) == len(printed["ids"]) + 1
    assert table[-1].startswith(f"{len(printed['ids'])} tokens, {len(TEXT)} characters")
    position, token, piece = table[0].split(maxsplit=2)
    assert (int(position), int(token), piece) == (0, printed["ids"][0], repr(printed["pieces"][0]))


def test_decode_gives_back_the_text_and_refuses_ids_it_has_not(tokenizer_path, tmp_path, capsys):
    tokenizer = load_tokenizer(tokenizer_path)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert main(["tokenizer", "decode", str(tokenizer_path), ",".join(map(str, ids))]) == 0
    assert capsys.readouterr().out == TEXT + "\n"
    assert main(["tokenizer", "decode", str(tokenizer_path), f"1,{tokenizer.vocab_size}"]) == 2
    assert f"ids [{tokenizer.vocab_size}] are outside this tokenizer's {tokenizer.vocab_size} ids" in \
        capsys.readouterr().err
    assert main(["tokenizer", "decode", str(tokenizer_path), "1,two"]) == 2
    assert "'1,two' is not a comma-separated list of integer token ids" in capsys.readouterr().err
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    assert main(["tokenizer", "encode", str(tmp_path / "run"), "--text", "x"]) == 2
    assert "A run directory keeps its tokenizer in each checkpoint" in capsys.readouterr().err
    assert main(["tokenizer", "encode", str(tokenizer_path), "--file", str(tmp_path / "nowhere.txt")]) == 2
    assert (f"--file {tmp_path / 'nowhere.txt'}: no such file; give the path of a text file holding the text."
            in capsys.readouterr().err)
