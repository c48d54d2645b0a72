"""``meshlm adapt-vocab``: after resizing to an extended tokenizer every old token's logit is the
old model's exactly (tied and untied heads), each new row is the mean of its base pieces' rows,
spare rows are reused and a growing vocabulary keeps the model's padding, and the written folder
loads and generates with the new tokenizer; mistakes are refused in one sentence."""

from __future__ import annotations

import json
import random
import shlex
import shutil
from pathlib import Path

import pytest
import tokenizers
import torch

from meshlm.adapt.vocab import adapt_vocab_model, new_vocab_size
from meshlm.checkpoint.model_files import load_model, save_model
from meshlm.cli import main
from meshlm.config import load_run_config
from meshlm.data.tokenizer_extension import base_pieces, extend_tokenizer
from meshlm.data.tokenizer_training import train_tokenizer
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel

WORDS = ["isinstance", "gradient", "optimizer", "hidden_states", "checkpoint", "tensor", "return", "self"]


def domain_text(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"def f({rng.choice(WORDS)}):\n    return isinstance({rng.choice(WORDS)}, {rng.choice(WORDS)})\n"
            for _ in range(count)]


@pytest.fixture(scope="module")
def tokenizers_dir(tmp_path_factory) -> Path:
    """base/tokenizer.json (300 ids, trained on English) and new/tokenizer.json (+40 domain tokens)."""
    directory = tmp_path_factory.mktemp("vocab")
    general = directory / "general.jsonl"
    general.write_text("".join(json.dumps({"text": f"Shall I compare thee to a summer's day, line {i}?"}) + "\n"
                               for i in range(200)))
    train_tokenizer([general], 300, directory / "base" / "tokenizer.json")
    domain = directory / "domain.jsonl"
    domain.write_text("".join(json.dumps({"text": text}) + "\n" for text in domain_text(200, seed=0)))
    extend_tokenizer(directory / "base" / "tokenizer.json", [domain], 40, directory / "new" / "tokenizer.json")
    return directory


def load_pair(directory: Path) -> tuple[tokenizers.Tokenizer, tokenizers.Tokenizer]:
    return tuple(tokenizers.Tokenizer.from_file(str(directory / kind / "tokenizer.json")) for kind in ("base", "new"))


def small_model(vocab_size: int, tied: bool) -> LanguageModel:
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=vocab_size, hidden_size=32, pattern="*-*-", num_attention_heads=4,
                         ffn_hidden_size=64, tie_embeddings=tied)
    return LanguageModel(config).eval()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("model_vocab, pad, expected_vocab", [(300, None, 340), (384, None, 384), (320, 64, 384)],
                         ids=["exact-grows", "spare-rows-reused", "padded-grows"])
def test_old_logits_are_unchanged_and_new_rows_are_the_mean_of_their_pieces(tokenizers_dir, tied, model_vocab, pad,
                                                                             expected_vocab):
    base, new = load_pair(tokenizers_dir)
    pieces = base_pieces(base, new)
    model = small_model(model_vocab, tied)
    adapted = adapt_vocab_model(model, pieces, base_size=300, pad_to_multiple=pad).eval()
    assert adapted.config.vocab_size == expected_vocab
    old_ids = torch.tensor([base.encode(text).ids[:24] for text in domain_text(3, seed=1)])
    with torch.no_grad():
        before, after = model(old_ids).logits, adapted(old_ids).logits
    assert torch.equal(after[..., :300], before[..., :300])  # every old token's logit, at every position
    for name in ("embedding.weight", "output.weight"):
        if tied and name == "output.weight":
            continue
        old, resized = model.state_dict()[name], adapted.state_dict()[name]
        assert torch.equal(resized[:300], old[:300])
        for token_id, piece_ids in pieces.items():
            assert torch.allclose(resized[token_id], old[piece_ids].mean(0), atol=1e-6), (name, token_id)
        if model_vocab >= 340:  # spare rows past the new tokens are left as they were
            assert torch.equal(resized[340:model_vocab], old[340:model_vocab])
        if expected_vocab > max(model_vocab, 340):  # added padding: the mean of the base rows
            assert torch.allclose(resized[-1], old[:300].mean(0), atol=1e-6)
    probabilities = torch.softmax(after[..., :340], dim=-1)[..., 300:340].sum(-1)
    assert (probabilities > 0).all() and (probabilities < 1).all()  # new tokens get some mass


def test_new_vocab_size_keeps_the_padding():
    assert new_vocab_size(384, 340) == 384
    assert new_vocab_size(384, 400) == 512 and new_vocab_size(300, 340) == 340
    assert new_vocab_size(300, 340, pad_to_multiple=64) == 384


def test_cli_writes_a_folder_that_loads_and_generates(tokenizers_dir, tmp_path, capsys):
    model = small_model(384, tied=False)
    save_model(model, tmp_path / "run" / "checkpoints" / "step_5", tokenizer_dir=tokenizers_dir / "base")
    new_file = tokenizers_dir / "new" / "tokenizer.json"
    assert main(["adapt-vocab", str(tmp_path / "run"), "--tokenizer", str(new_file), str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out", "run"]  # no temporary folder left
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == new_file.read_bytes()
    assert (tmp_path / "out" / "tokenizer_config.json").is_file()
    loaded = load_model(tmp_path / "out").eval()
    _, new = load_pair(tokenizers_dir)
    reference = adapt_vocab_model(model, base_pieces(load_pair(tokenizers_dir)[0], new), 300)
    for name, value in reference.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    command = next(line.strip() for line in printed.splitlines() if line.strip().startswith("meshlm train CONFIG"))
    assert f"train.init_from={tmp_path / 'out'}" in command and "model.vocab_size=384" in command
    assert "data.tokenizer=" in command and "data.prefixes=" in command
    run = load_run_config(None, shlex.split(command)[3:])  # the printed words parse as the run's overrides
    assert run.model.vocab_size == 384 and run.data.weights == [0.9, 0.1] and run.data.blend is None
    prompt = "def f(gradient):\n    return isinstance("
    assert max(new.encode(prompt).ids) >= 300  # the folder's tokenizer uses the new tokens
    assert main(["generate", str(tmp_path / "out"), "--prompt", prompt, "--max-new-tokens", "6", "--greedy",
                 "--json", "--device", "cpu"]) == 0
    generated = json.loads(capsys.readouterr().out.strip())
    assert len(generated["ids"]) == 6 and max(generated["ids"]) < 340 and generated["text"] == new.decode(generated["ids"])


@pytest.mark.parametrize("case, words", [
    ("not-an-extension", "does not keep the ids of"),
    ("no-tokenizer", "holds no tokenizer file"),
    ("model-too-small", "is not the model's tokenizer"),
    ("out-exists", "already exists"),
])
def test_refusals_are_one_sentence(tokenizers_dir, tmp_path, capsys, case, words):
    save_model(small_model(256 if case == "model-too-small" else 300, tied=True), tmp_path / "model",
               tokenizer_dir=tokenizers_dir / "base")
    new_file = tokenizers_dir / "new" / "tokenizer.json"
    if case == "not-an-extension":
        other = tmp_path / "other.jsonl"
        other.write_text("".join(json.dumps({"text": text}) + "\n" for text in domain_text(50, seed=4)))
        new_file = train_tokenizer([other], 320, tmp_path / "other" / "tokenizer.json")
    elif case == "no-tokenizer":
        (tmp_path / "model" / "tokenizer.json").unlink()
    elif case == "out-exists":
        (tmp_path / "out").mkdir()
    code = main(["adapt-vocab", str(tmp_path / "model"), "--tokenizer", str(new_file), str(tmp_path / "out")])
    error = capsys.readouterr().err.strip()
    assert code == 2 and words in error and len(error.splitlines()) == 1, error
    assert (case == "out-exists") == (tmp_path / "out").exists()
    shutil.rmtree(tmp_path / "model")
