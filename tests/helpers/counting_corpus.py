"""A tiny learnable corpus for trainer-level tests: 64 token ids; every document counts up in
steps of 3 (mod 63) from a random start and ends with the EOS id 63, so a 2-block model learns
"next = previous + 3" within a few dozen steps. It comes with a word-level tokenizer (``t0`` ...
``t62``, ``<|endoftext|>``) named in its blend file, so checkpoints carry a tokenizer and text
generation works."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import tokenizers

from meshlm.data.indexed import TokenStoreWriter

VOCAB_SIZE = 64
EOS_ID = VOCAB_SIZE - 1


def write_corpus(directory: Path, num_documents: int = 120, max_length: int = 80) -> Path:
    """Token store ``corpus`` + ``tokenizer.json`` + ``blend.json`` in ``directory`` (documents of 20
    to ``max_length`` - 1 tokens plus EOS); returns the blend file."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    with TokenStoreWriter(directory / "corpus", vocab_size=VOCAB_SIZE) as writer:
        for _ in range(num_documents):
            start, length = rng.integers(0, EOS_ID), rng.integers(20, max_length)
            writer.add_document(np.append((start + 3 * np.arange(length)) % EOS_ID, EOS_ID))
    vocab = {f"t{index}": index for index in range(EOS_ID)} | {"<|endoftext|>": EOS_ID}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    blend = directory / "blend.json"
    blend.write_text(json.dumps({"tokenizer": "tokenizer.json", "datasets": [{"prefix": "corpus", "weight": 1}]}))
    return blend


__all__ = ["EOS_ID", "VOCAB_SIZE", "write_corpus"]
