"""``meshlm preprocess --chat``: conversations (JSONL ``messages``) into a token store with a loss mask.

    meshlm preprocess --chat --input chats.jsonl --tokenizer tokenizer.json --out data/sft \\
        [--max-vocab-size 4096]

Each line of the input is one conversation, ``{"messages": [{"role": "user", "content": ...},
{"role": "assistant", "content": ...}, ...]}``, with ``"tools": [...]`` beside ``messages`` for
the functions offered (``meshlm/data/chat.py`` describes the roles, tools, tool calls and
templates), or the same conversation as ShareGPT, Alpaca or prompt/completion
records write it (``meshlm/data/chat_formats.py``). Each conversation becomes one document of the store, rendered by the
chat template and tokenized with its loss mask (1 on the assistant's reply tokens), which is
written to ``PREFIX.mask.bin`` beside ``PREFIX.bin`` (``meshlm/data/indexed.py``). Bad input --
a line that is not JSON, no ``messages``, an unknown role, no assistant turn -- is refused with
the file and the line.

**The tokenizer written beside the store** (``PREFIX.tokenizer/``): a copy of ``--tokenizer``
and its ``tokenizer_config.json`` / ``special_tokens_map.json``. With meshlm's default template,
the markers it lacks (``<|user|>``, ``<|end|>``, ...) are added to the copy as special tokens,
with ids after its whole vocabulary (so no old id changes meaning); ``--max-vocab-size`` (the
model's ``vocab_size``) refuses additions that would not fit the model. When a reply opens with a
think block, ``<think>`` and ``</think>`` are added the same way (the reasoning toggle,
``meshlm/data/reasoning.py``); the input is read once first to find out. Adding tokens needs a
Hugging Face ``tokenizer.json``; a SentencePiece or tiktoken tokenizer must already have them
(or bring its own ``chat_template``). ``PREFIX.meta.json`` names this copy, so training copies
it, template and all, into its checkpoints, and ``meshlm generate --chat`` renders prompts the
same way; it also records ``"chat": true`` and which template was used.

Conversations are few and short next to a pretraining corpus, so this runs in one process
(``--workers`` does not apply).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import tokenizers

from meshlm.data.chat import (ChatTemplate, check_messages, encode_segments, load_chat_template,
                              missing_special_tokens, token_id, tool_definitions)
from meshlm.data.chat_formats import conversation
from meshlm.data.jsonl import json_lines
from meshlm.data.reasoning import REASONING_SPECIAL_TOKENS, check_think_blocks, has_think_block
from meshlm.data.indexed import TokenStoreWriter
from meshlm.data.readers import expand_inputs
from meshlm.data.tokenizer import (SPECIAL_TOKEN_CONFIG_FILES, find_tokenizer_file, load_tokenizer,
                                   tokenizer_format)
from meshlm.errors import DataError


@dataclass
class ChatPreprocessResult:
    prefix: str
    num_documents: int
    """Conversations stored, one document each."""
    num_tokens: int


def chat_tokenizer_folder(out_prefix: str | os.PathLike) -> Path:
    """``PREFIX.tokenizer/``: where the store's tokenizer (with the chat tokens) is written."""
    return Path(f"{out_prefix}.tokenizer")


def write_chat_tokenizer(tokenizer_path: str | os.PathLike, folder: Path, template: ChatTemplate,
                         max_vocab_size: int | None = None, extra_tokens: tuple[str, ...] = ()) -> Path:
    """Copy the tokenizer into ``folder``, adding the template's missing special tokens; the file.
    ``extra_tokens`` (the think tags, ``meshlm/data/reasoning.py``) are added too when missing, if
    the tokenizer is a tokenizer.json; other formats keep them as ordinary text."""
    source = find_tokenizer_file(tokenizer_path)
    tokenizer = load_tokenizer(source)
    missing = missing_special_tokens(tokenizer, template)
    if tokenizer_format(source) == "huggingface":
        missing += [token for token in extra_tokens if token not in missing and token_id(tokenizer, token) is None]
    folder.mkdir(parents=True, exist_ok=True)
    for name in SPECIAL_TOKEN_CONFIG_FILES:
        if (source.parent / name).is_file():
            shutil.copyfile(source.parent / name, folder / name)
    target = folder / ("tokenizer.json" if tokenizer_format(source) == "huggingface" else source.name)
    if not missing:
        shutil.copyfile(source, target)
        return target
    if tokenizer_format(source) != "huggingface":
        raise DataError(f"{source}: this {tokenizer_format(source)} tokenizer lacks the chat tokens "
                        f"{', '.join(missing)} of meshlm's default template, and only a Hugging Face tokenizer.json "
                        "can have tokens added; use a tokenizer.json, or add a chat_template to tokenizer_config.json.")
    if max_vocab_size is not None and tokenizer.vocab_size + len(missing) > max_vocab_size:
        raise DataError(f"{source}: adding the chat tokens {', '.join(missing)} would give "
                        f"{tokenizer.vocab_size + len(missing)} ids, more than --max-vocab-size {max_vocab_size}; "
                        "raise the model's vocab_size or use a tokenizer that already has these tokens.")
    backend = tokenizers.Tokenizer.from_file(str(source))
    backend.add_special_tokens([tokenizers.AddedToken(token, special=True, normalized=False) for token in missing])
    backend.save(str(target))
    return target


def read_conversations(files: list[Path], messages_key: str = "messages") -> Iterator[tuple[str, list, list | None]]:
    """("FILE, line N", messages, tools) for every record of the JSON ``files``, in any shape of
    ``chat_formats.py`` (messages, ShareGPT, Alpaca, prompt/completion), checked; ``tools``: the
    record's offered functions (``chat.tool_definitions``), None without."""
    for where, record in json_lines(files, "chat data", "conversation"):
        messages = conversation(record, where, messages_key)
        check_messages(messages, where)
        check_think_blocks(messages, where)
        yield where, messages, tool_definitions(record.get("tools") if isinstance(record, dict) else None, where)


def preprocess_chat(inputs, tokenizer_path: str | os.PathLike, out_prefix: str | os.PathLike,
                    max_vocab_size: int | None = None, messages_key: str = "messages") -> ChatPreprocessResult:
    """Render, tokenize and mask every conversation of ``inputs`` into the chat store ``out_prefix``."""
    files = expand_inputs(inputs)
    template = load_chat_template(find_tokenizer_file(tokenizer_path))
    reasoning = any(has_think_block(messages) for _, messages, _ in read_conversations(files, messages_key))
    tokenizer_file = write_chat_tokenizer(tokenizer_path, chat_tokenizer_folder(out_prefix), template, max_vocab_size,
                                          REASONING_SPECIAL_TOKENS if reasoning else ())
    tokenizer = load_tokenizer(tokenizer_file)
    store_folder = os.path.dirname(os.path.abspath(f"{out_prefix}.meta.json"))  # paths relative to it, as preprocess
    metadata = {"tokenizer": os.path.relpath(os.path.abspath(tokenizer_file), store_folder),
                "tokenizer_vocab_size": tokenizer.vocab_size, "append_eos": False, "text_key": messages_key,
                "chat": True, "chat_template": "meshlm default" if template.is_default else "tokenizer"}
    with TokenStoreWriter(out_prefix, tokenizer.vocab_size, metadata, loss_mask=True) as writer:
        for where, messages, tools in read_conversations(files, messages_key):
            ids, mask = encode_segments(tokenizer, template.segments(messages, tools))
            writer.add_document(ids, source=where, loss_mask=mask)
    return ChatPreprocessResult(str(out_prefix), writer.num_documents, writer.num_tokens)


__all__ = ["ChatPreprocessResult", "chat_tokenizer_folder", "preprocess_chat", "read_conversations", "write_chat_tokenizer"]
