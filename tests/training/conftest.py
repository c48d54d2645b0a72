"""Fixtures for the trainer tests: a tiny learnable corpus and a builder of tiny run configs.

The corpus is ``tests/helpers/counting_corpus.py``'s (64 token ids counting up in steps of 3, with
a word-level tokenizer named in its blend file).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from meshlm.config import load_run_config
from tests.helpers.counting_corpus import write_corpus

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
