"""Small offline tokenizers with chat markers, shared by tests and bench/ scripts.

- ``write_char_tokenizer``: one token per character of digits, lower-case letters, 'W', space,
  newline and '+-*?=.', plus meshlm's default chat markers (eos ``<|endoftext|>``): arithmetic
  prompts and replies ("What is 17 + 25?") tokenize without any training (``meshlm rl`` tests,
  ``bench/post_training.py``).
- ``write_reasoning_chat_tokenizer``: a 300-token byte-level BPE trained on a few sentences, then
  written as ``meshlm preprocess --chat`` writes it, with the template markers and the think tags.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

CHARACTERS = string.digits + string.ascii_lowercase + "W \n+-*?=."
SPECIAL_TOKENS = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|tool_call|>", "<|end|>"]
SENTENCES = ["the cat sat on the mat.", "a dog sat on a log.", "the cat and the dog are friends."] * 4


def write_char_tokenizer(directory: Path) -> Path:
    """tokenizer.json + tokenizer_config.json (eos <|endoftext|>) in ``directory``."""
    import tokenizers

    directory.mkdir(parents=True, exist_ok=True)
    vocab = {character: index for index, character in enumerate(CHARACTERS)} | {"<unk>": len(CHARACTERS)}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.decoder = tokenizers.decoders.Fuse()
    tokenizer.add_special_tokens([tokenizers.AddedToken(token, special=True, normalized=False)
                                  for token in SPECIAL_TOKENS])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return directory / "tokenizer.json"


def write_reasoning_chat_tokenizer(folder: Path) -> Path:
    """The chat tokenizer folder (``folder / "chat"``) of a small BPE with the think tags."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from meshlm.data.chat import ChatTemplate
    from meshlm.data.chat_preprocess import write_chat_tokenizer
    from meshlm.data.reasoning import REASONING_SPECIAL_TOKENS

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(SENTENCES, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    backend.save(str(folder / "base.json"))
    write_chat_tokenizer(folder / "base.json", folder / "chat", ChatTemplate(), extra_tokens=REASONING_SPECIAL_TOKENS)
    return folder / "chat"
