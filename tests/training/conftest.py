"""Fixtures for the trainer tests: a tiny learnable corpus and a builder of tiny run configs.

The corpus is 64 token ids; every document counts up in steps of 3 (mod 63) from a random
start and ends with the EOS id 63, so a 2-block model learns "next = previous + 3" within a few
dozen steps. It comes with a word-level tokenizer (``t0`` ... ``t62``, ``<|endoftext|>``) named
in its blend file, so checkpoints carry a tokenizer and text generation works.
(Tests run in pytest's importlib mode, so helpers are handed out as fixtures, not imported.)
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tokenizers

from meshlm.config import load_run_config
from meshlm.data.indexed import TokenStoreWriter

VOCAB_SIZE = 64
EOS_ID = VOCAB_SIZE - 1


def write_corpus(directory: Path, num_documents: int = 120) -> Path:
    """Token store ``corpus`` + ``tokenizer.json`` + ``blend.json`` in ``directory``; returns the blend."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    with TokenStoreWriter(directory / "corpus", vocab_size=VOCAB_SIZE) as writer:
        for _ in range(num_documents):
            start, length = rng.integers(0, EOS_ID), rng.integers(20, 80)
            writer.add_document(np.append((start + 3 * np.arange(length)) % EOS_ID, EOS_ID))
    vocab = {f"t{index}": index for index in range(EOS_ID)} | {"<|endoftext|>": EOS_ID}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    blend = directory / "blend.json"
    blend.write_text(json.dumps({"tokenizer": "tokenizer.json", "datasets": [{"prefix": "corpus", "weight": 1}]}))
    return blend


@pytest.fixture(scope="session")
def corpus_blend(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture
def make_config(corpus_blend, tmp_path):
    """``make_config("train.steps=6", ...)``: a tiny CPU fp32 run in tmp_path/run, plus overrides."""

    def make(*overrides: str):
        base = ["model.vocab_size=64", "model.hidden_size=32", "model.pattern=*-", "model.num_attention_heads=4",
                "train.seq_len=16", "train.micro_batch_size=2", "train.global_batch_size=4", "train.steps=4",
                "train.log_every=1", "train.eval_every=2", "train.eval_batches=2", "train.save_every=2",
                "train.progress=false", "train.tensorboard=false", "train.plot=false", "train.device=cpu",
                f"train.run_dir={tmp_path / 'run'}", f"data.blend={corpus_blend}", "data.split=90,10,0",
                "optim.lr=3e-3", "optim.warmup_steps=2"]
        return load_run_config(None, [*base, *overrides])

    return make
