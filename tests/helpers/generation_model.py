"""A tiny language model and a small byte-level BPE for the generation tests (``meshlm generate``)."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel

SENTENCES = ["the cat sat on the mat.", "a dog sat on a log.", "the cat and the dog are friends."] * 4


def tiny_model(seed: int = 0) -> LanguageModel:
    torch.manual_seed(seed)  # vocab 320 > the tokenizer's ~300: a padded vocabulary
    return LanguageModel(ModelConfig(vocab_size=320, hidden_size=32, pattern="*-*-", num_attention_heads=4,
                                     num_kv_heads=2, init_std=0.1))


def write_sentence_tokenizer(directory: Path) -> Path:
    """A 300-token byte-level BPE trained on SENTENCES (eos <|endoftext|>), saved in ``directory``."""
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(SENTENCES, trainer)
    directory.mkdir(parents=True)
    backend.save(str(directory / "tokenizer.json"))
    return directory


__all__ = ["SENTENCES", "tiny_model", "write_sentence_tokenizer"]
