"""SFT end to end: a chat store from ``meshlm preprocess --chat`` trains, from ``train.init_from``,
with the loss on assistant tokens only, and ``meshlm generate --chat`` answers from the checkpoint."""

from __future__ import annotations

import json

import numpy as np
import pytest

from meshlm.checkpoint.folders import latest_checkpoint
from meshlm.cli import main
from meshlm.data.chat_preprocess import preprocess_chat
from meshlm.data.tokenizer import load_tokenizer
from meshlm.inference.chat import chat_prompt
from meshlm.training.trainer import Trainer, train


@pytest.fixture(scope="module")
def chat_store(corpus_blend, tmp_path_factory):
    """40 word-level conversations ("t3 t6" -> "t9 t12"), stored with the corpus tokenizer + chat tokens."""
    rng = np.random.default_rng(0)
    lines = []
    for _ in range(40):
        start = int(rng.integers(0, 50))
        question, answer = (" ".join(f"t{(start + 3 * i) % 63}" for i in span) for span in (range(2), range(2, 5)))
        lines.append(json.dumps({"messages": [{"role": "user", "content": question},
                                              {"role": "assistant", "content": answer}]}))
    folder = tmp_path_factory.mktemp("chat")
    (folder / "chats.jsonl").write_text("\n".join(lines) + "\n")
    preprocess_chat([folder / "chats.jsonl"], corpus_blend.parent / "tokenizer.json", folder / "sft",
                    max_vocab_size=128)
    return folder / "sft"


def test_sft_from_a_pretrained_checkpoint_then_generate_chat(make_config, chat_store, tmp_path, capsys):
    pretrain = make_config("model.vocab_size=128", "train.steps=2", "train.eval_every=0", "train.save_every=2",
                           "optim.warmup_steps=1", f"train.run_dir={tmp_path / 'pretrain'}")
    train(pretrain)
    config = make_config("model.vocab_size=128", f"data.prefixes=[{chat_store}]", "data.blend=null",
                         "train.steps=2", "train.eval_every=0", "train.save_every=2", "optim.warmup_steps=1",
                         f"train.init_from={tmp_path / 'pretrain/checkpoints/step_2'}")
    trainer = Trainer(config)
    assert "chat store" in capsys.readouterr().out  # data.document_boundaries turned on, with a note
    sample = trainer.data.train[0]
    assert "document_ids" in sample
    assert 0 < int((sample["labels"] != -100).sum()) < len(sample["labels"])
    result = train(config)
    assert result.step == 2 and all(np.isfinite(loss) for loss in result.losses.values())
    checkpoint = latest_checkpoint(config.train.run_dir)
    tokenizer = load_tokenizer(checkpoint / "tokenizer.json")
    prompt, stop_ids = chat_prompt(tokenizer, "t3 t6", system="be brief")
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    end = encode("<|end|>")
    assert prompt == (encode("<|system|>") + encode("\n") + encode("be brief") + end + encode("\n<|user|>\n")
                      + encode("t3 t6") + end + encode("\n<|assistant|>\n"))
    assert stop_ids == end + [63]  # <|end|>, then the tokenizer's eos
    capsys.readouterr()
    assert main(["generate", str(config.train.run_dir), "--chat", "--system", "be brief", "--prompt", "t3 t6",
                 "--max-new-tokens", "6", "--greedy", "--device", "cpu", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(printed["ids"]) <= 6 and not set(printed["ids"]) & set(stop_ids)
    assert printed["text"] == tokenizer.decode(printed["ids"])
