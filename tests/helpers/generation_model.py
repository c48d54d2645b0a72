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


__all__ = ["SENTENCES", "positional_script_model", "tiny_model", "write_sentence_tokenizer"]


def word_ids(tokenizer) -> list[int]:
    """The single token ids of " cat", " dog" and " mat" in the small BPE."""
    ids = [tokenizer.encode(word, add_special_tokens=False) for word in (" cat", " dog", " mat")]
    assert all(len(piece) == 1 for piece in ids)
    return [piece[0] for piece in ids]


def scripted_model(chain: list[int]) -> LanguageModel:
    """A model whose greedy next token after ``chain[i]`` is ``chain[i + 1]``: its blocks add nothing
    (zero output projections), so the last hidden state is the normalized embedding of the last token;
    each chain token's embedding is its own unit vector, and the output row of its successor is that vector."""
    model = LanguageModel(ModelConfig(vocab_size=320, hidden_size=32, pattern="*-", num_attention_heads=4,
                                      num_kv_heads=2, tie_embeddings=False))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")) or name == "output.weight":
                parameter.zero_()
        for k, (token, successor) in enumerate(zip(chain, chain[1:])):
            model.embedding.weight[token] = torch.nn.functional.one_hot(torch.tensor(k), 32).float()
            model.output.weight[successor, k] = 1.0
    return model


def thinking_model(tokenizer) -> LanguageModel:
    """A model that always answers ``<think> cat dog</think> mat<|end|>`` after a prompt ending in a
    newline (``scripted_model``). ``tokenizer``: the chat BPE with the think tags
    (tests/helpers/chat_tokenizers.py)."""
    from meshlm.data.chat import token_id

    cat, dog, mat = word_ids(tokenizer)
    return scripted_model(tokenizer.encode("\n", add_special_tokens=False) + [
        token_id(tokenizer, "<think>"), cat, dog, token_id(tokenizer, "</think>"), mat, token_id(tokenizer, "<|end|>")])


def positional_script_model(start: int, reply: list[int], vocab_size: int = 320) -> LanguageModel:
    """A model whose greedy token at position ``start + k`` is ``reply[k]``, whatever came before: the
    token embeddings are zero and the blocks add nothing (zero output projections), so the last
    hidden state is the normalized learned embedding of its position, position p's own unit vector,
    and the output row of ``reply[k]`` is position ``start + k - 1``'s. For replies with repeated
    tokens (JSON), which ``scripted_model`` cannot chain; the prompt must be ``start`` tokens long."""
    hidden = 16 * ((start + len(reply)) // 16 + 1)
    model = LanguageModel(ModelConfig(vocab_size=vocab_size, hidden_size=hidden, pattern="*-", num_attention_heads=4,
                                      tie_embeddings=False, position_embedding="learned",
                                      max_position_embeddings=hidden + 64))  # room for tokens past the script
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")) or name in ("output.weight", "embedding.weight"):
                parameter.zero_()
        model.position_embedding.weight.zero_()
        model.position_embedding.weight[:hidden].copy_(torch.eye(hidden))
        for k, token in enumerate(reply):
            model.output.weight[token, start + k - 1] = 1.0
    return model
