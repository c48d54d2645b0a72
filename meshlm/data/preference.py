"""Preference data: chosen / rejected replies (or scored replies) as padded rows for reward models and DPO.

    meshlm preprocess --preference --input pairs.jsonl --tokenizer tokenizer.json --out data/prefs

**Input** (JSONL, one example per line). A *pair* judges two replies to one conversation::

    {"prompt": "What is 2+2?", "chosen": "4.", "rejected": "5."}
    {"messages": [{"role": "system", ...}, {"role": "user", ...}], "chosen": {"role": "assistant",
     "content": "..."}, "rejected": "..."}

``prompt`` is a single user turn; ``messages`` is the whole context; each reply is a string or an
assistant message (which may carry ``tool_calls``). TRL's conversational pairs and UltraFeedback's
whole conversations are read too (``preference_formats.py``). A *scored* example (for an attribute reward
model, e.g. HelpSteer) is a conversation that ends with the reply being rated, and its ratings::

    {"messages": [{"role": "user", ...}, {"role": "assistant", ...}], "scores": {"helpfulness": 3, ...}}

A file holds one kind or the other. Each reply is rendered with the chat template exactly as
``meshlm preprocess --chat`` renders conversations for SFT (``meshlm/data/chat.py``), and cut after
the reply's end-of-turn marker; only the *final* reply is marked trained (earlier assistant turns
are context). The store is a chat token store (``PREFIX.bin/.idx/.mask.bin``, its tokenizer copied
to ``PREFIX.tokenizer/``) whose ``PREFIX.meta.json`` says ``"preference": "pairs"`` -- document 2i is
pair i's chosen conversation, 2i + 1 its rejected one -- or ``"preference": "scores"`` with
``"attributes"`` (every name seen, in order) and ``PREFIX.scores.npy`` (float32 [examples,
attributes], NaN where an example does not rate an attribute; the MSE skips those).

**Rows.** ``PreferenceDataset`` item i is example i of one fixed order (each epoch a fresh
permutation of the split's examples, from the seed), as padded rows of ``seq_len`` tokens: two
rows (chosen, rejected) for a pair, one for a scored example, never packed together. A micro-batch
of B pairs is 2B rows, chosen and rejected interleaved (rows 2b and 2b + 1). Each row has

    input_ids[t]  the conversation's tokens, then 0 (padding, after the last token)
    labels[t]     the next token where it belongs to the reply, else IGNORE_INDEX
    last_index    the position of the row's last token (the reply's end-of-turn marker)

Padding sits after ``last_index``, so causal attention keeps it from changing anything the
losses read. **Too long:** a row longer than ``seq_len`` keeps its last ``seq_len`` tokens (the
context is cut from the left; the reply is kept whole); an example whose reply alone does not
fit (with one context token before it) is skipped, and the count is given in one warning.

The data split (``data.split``) is by examples, in store order, as for token stores.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from meshlm.data.chat import (ChatTemplate, Segment, check_messages, encode_segments, load_chat_template,
                              tool_definitions)
from meshlm.data.chat_preprocess import chat_tokenizer_folder, write_chat_tokenizer
from meshlm.data.gpt_dataset import IGNORE_INDEX, SPLIT_NAMES, split_document_range
from meshlm.data.indexed import TokenStore, TokenStoreWriter, metadata_path
from meshlm.data.jsonl import json_lines
from meshlm.data.preference_formats import pair_conversations
from meshlm.data.readers import expand_inputs
from meshlm.data.tokenizer import find_tokenizer_file, load_tokenizer
from meshlm.errors import DataError

PAIRS, SCORES = "pairs", "scores"
"""The two kinds of preference store (``"preference"`` in PREFIX.meta.json)."""


def scores_path(prefix: str | os.PathLike) -> Path:
    """``PREFIX.scores.npy``: a scored store's ratings, float32 [examples, attributes]."""
    return Path(f"{prefix}.scores.npy")


# --- reading the JSONL ---------------------------------------------------------------------------

def read_examples(files: list[Path]) -> Iterator[tuple[str, str, dict]]:
    """("FILE, line N", kind, example) for every non-blank line: kind 'pairs' with
    {"chosen": messages, "rejected": messages}, or 'scores' with {"messages", "scores"}; checked."""
    line_format = '{"prompt" or "messages", "chosen", "rejected"} or {"messages", "scores"}'
    for where, record in json_lines(files, "preference data", line_format):
        yield parse_example(record, where)


def parse_example(record, where: str) -> tuple[str, str, dict]:
    """(where, kind, example) of one parsed line, checked."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: each line must be a JSON object.")
    if "scores" in record:
        scores = record["scores"]
        if not isinstance(scores, dict) or not scores or not all(
                isinstance(value, (int, float)) and not isinstance(value, bool) for value in scores.values()):
            raise DataError(f"{where}: 'scores' must be an object of numbers, e.g. {{\"helpfulness\": 3}}.")
        messages = record.get("messages")
        if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict) \
                or messages[-1].get("role") != "assistant":
            raise DataError(f"{where}: a scored example needs 'messages' ending with the assistant reply it rates.")
        check_messages(messages, where)
        return where, SCORES, {"messages": messages, "scores": {str(k): float(v) for k, v in scores.items()},
                               "tools": tool_definitions(record.get("tools"), where)}
    if "chosen" not in record or "rejected" not in record:
        raise DataError(f"{where}: each line needs 'chosen' and 'rejected' replies (a pair) or 'messages' and "
                        "'scores' (a rated reply).")
    pair = pair_conversations(record, where)
    for key, messages in pair.items():
        check_messages(messages, f"{where} ({key})")
    return where, PAIRS, {**pair, "tools": tool_definitions(record.get("tools"), where)}


# --- rendering -----------------------------------------------------------------------------------

def final_reply_segments(template: ChatTemplate, messages: list[dict], tools: list[dict] | None = None
                         ) -> list[Segment]:
    """The rendered conversation (with the functions ``tools`` offers in its prompt) up to the end
    of its last reply, only that reply trained."""
    segments = template.segments(messages, tools)
    last = max(index for index, segment in enumerate(segments) if segment.trained)
    return [Segment(segment.text, index == last) for index, segment in enumerate(segments[:last + 1])]


@dataclass
class PreferencePreprocessResult:
    prefix: str
    kind: str
    """'pairs' or 'scores'."""
    num_examples: int
    num_tokens: int
    attributes: list[str]
    """The rated attributes (scored stores; [] for pairs)."""


def preprocess_preference(inputs, tokenizer_path: str | os.PathLike, out_prefix: str | os.PathLike,
                          max_vocab_size: int | None = None) -> PreferencePreprocessResult:
    """Render, tokenize and mask every example of ``inputs`` into the preference store ``out_prefix``."""
    files = expand_inputs(inputs)
    template = load_chat_template(find_tokenizer_file(tokenizer_path))
    tokenizer_file = write_chat_tokenizer(tokenizer_path, chat_tokenizer_folder(out_prefix), template, max_vocab_size)
    tokenizer = load_tokenizer(tokenizer_file)
    store_folder = os.path.dirname(os.path.abspath(metadata_path(out_prefix)))
    metadata = {"tokenizer": os.path.relpath(os.path.abspath(tokenizer_file), store_folder),
                "tokenizer_vocab_size": tokenizer.vocab_size, "append_eos": False, "text_key": "messages",
                "chat": True, "chat_template": "meshlm default" if template.is_default else "tokenizer"}
    kind, first_where, ratings, attributes = None, "", [], {}
    with TokenStoreWriter(out_prefix, tokenizer.vocab_size, metadata, loss_mask=True) as writer:
        for where, example_kind, example in read_examples(files):
            if kind is None:
                kind, first_where = example_kind, where
            elif example_kind != kind:
                raise DataError(f"{where}: a {example_kind[:-1]} example after {kind} ({first_where}); a preference "
                                "store holds pairs or scored replies, not both: preprocess them separately.")
            conversations = [example["chosen"], example["rejected"]] if kind == PAIRS else [example["messages"]]
            for messages in conversations:
                ids, mask = encode_segments(tokenizer, final_reply_segments(template, messages, example["tools"]))
                if not mask.any():
                    raise DataError(f"{where}: the reply renders to no tokens; give it some content.")
                writer.add_document(ids, source=where, loss_mask=mask)
            if kind == SCORES:
                for name in example["scores"]:
                    attributes.setdefault(name, len(attributes))
                ratings.append(example["scores"])
        if kind is None:
            raise DataError(f"{', '.join(map(str, files))}: no examples; each line must hold a pair or a rated reply.")
        metadata.update({"preference": kind, "attributes": list(attributes)})
        if kind == SCORES:
            table = np.full((len(ratings), len(attributes)), np.nan, dtype=np.float32)
            for row, scores in enumerate(ratings):
                for name, value in scores.items():
                    table[row, attributes[name]] = value
            temporary = Path(f"{out_prefix}.scores.tmp.npy")
            np.save(temporary, table)
            os.replace(temporary, scores_path(out_prefix))
    examples = writer.num_documents // (2 if kind == PAIRS else 1)
    return PreferencePreprocessResult(str(out_prefix), kind, examples, writer.num_tokens, list(attributes))


# --- the store and the dataset --------------------------------------------------------------------

def preference_kind(prefix: str | os.PathLike) -> str | None:
    """'pairs' or 'scores' for a preference store, None for any other token store."""
    return TokenStore(prefix).metadata.get("preference")


class PreferenceStore:
    """A preference store on disk: its examples' documents, loss masks and (scored) ratings."""

    def __init__(self, prefix: str | os.PathLike):
        self.store = TokenStore(prefix)
        metadata = self.store.metadata
        self.kind = metadata.get("preference")
        if self.kind not in (PAIRS, SCORES) or self.store.loss_mask is None:
            raise DataError(f"{prefix}: not a preference store; write one with `meshlm preprocess --preference`.")
        self.rows_per_example = 2 if self.kind == PAIRS else 1
        self.attributes = list(metadata.get("attributes") or [])
        self.scores = None
        if self.kind == SCORES:
            self.scores = np.load(scores_path(prefix))
            if self.scores.shape != (len(self), len(self.attributes)):
                raise DataError(f"{scores_path(prefix)}: holds {self.scores.shape} ratings but the store has "
                                f"{len(self)} examples of {len(self.attributes)} attributes; re-run "
                                "`meshlm preprocess --preference`.")

    def __len__(self) -> int:
        return self.store.num_documents // self.rows_per_example

    def documents(self, example: int) -> list[int]:
        return [example * self.rows_per_example + row for row in range(self.rows_per_example)]

    def reply_start(self, document: int) -> int:
        """The position of the reply's first token in ``document``."""
        start, stop = self.store.offsets[document], self.store.offsets[document + 1]
        return int(np.argmax(self.store.loss_mask[start:stop]))

    def fits(self, example: int, seq_len: int) -> bool:
        """Every row's reply fits in ``seq_len`` tokens with one context token before it."""
        lengths = self.store.document_lengths
        return all(lengths[document] - self.reply_start(document) < seq_len for document in self.documents(example))

    def row(self, document: int, seq_len: int) -> tuple[np.ndarray, np.ndarray, int]:
        """(input_ids [seq_len], labels [seq_len], last_index) of ``document`` (module docstring)."""
        start, stop = int(self.store.offsets[document]), int(self.store.offsets[document + 1])
        start = max(start, stop - seq_len)  # too long: the context is cut from the left
        tokens = np.asarray(self.store.tokens[start:stop], dtype=np.int64)
        mask = np.asarray(self.store.loss_mask[start:stop], dtype=bool)
        input_ids = np.zeros(seq_len, dtype=np.int64)
        labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int64)
        input_ids[:len(tokens)] = tokens
        labels[:len(tokens) - 1] = np.where(mask[1:], tokens[1:], IGNORE_INDEX)
        return input_ids, labels, len(tokens) - 1


class PreferenceDataset(torch.utils.data.Dataset):
    """Example i of the split's global order (module docstring) as a dict of row tensors:
    ``input_ids`` / ``labels`` [rows, seq_len], ``last_index`` [rows] and, for scored examples,
    ``scores`` [rows, attributes]; rows = 2 (chosen, rejected) for pairs, 1 for scored replies."""

    def __init__(self, stores: list[PreferenceStore], seq_len: int, num_samples: int, seed: int, split,
                 split_name: str):
        self.stores, self.seq_len = stores, seq_len
        self.kind, self.rows_per_example = stores[0].kind, stores[0].rows_per_example
        examples, skipped = [], 0
        for number, store in enumerate(stores):
            start, stop = split_document_range(len(store), split, split_name)
            for example in range(start, stop):
                if store.fits(example, seq_len):
                    examples.append((number, example))
                else:
                    skipped += 1
        if skipped:
            warnings.warn(f"{stores[0].store.prefix}: {skipped} {split_name} example(s) skipped because a reply "
                          f"does not fit in train.seq_len={seq_len} tokens (longer contexts are cut from the left); "
                          "raise train.seq_len to keep them.", stacklevel=3)
        if not examples:
            raise DataError(f"{stores[0].store.prefix}: no {split_name} examples (data.split={split!r} leaves "
                            f"none that fit train.seq_len={seq_len}); add examples or change data.split.")
        self.examples = np.asarray(examples, dtype=np.int64)
        epochs = -(-num_samples // len(examples))
        split_number = SPLIT_NAMES.index(split_name)
        self.order = np.concatenate([np.random.default_rng([seed, split_number, epoch]).permutation(len(examples))
                                     for epoch in range(epochs)])[:num_samples]
        self.skipped = skipped

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        number, example = self.examples[self.order[index]]
        store = self.stores[number]
        rows = [store.row(document, self.seq_len) for document in store.documents(int(example))]
        item = {"input_ids": torch.from_numpy(np.stack([row[0] for row in rows])),
                "labels": torch.from_numpy(np.stack([row[1] for row in rows])),
                "last_index": torch.tensor([row[2] for row in rows], dtype=torch.int64)}
        if store.scores is not None:
            item["scores"] = torch.from_numpy(store.scores[example][None].copy())
        return item

    def read_batch(self, start: int, size: int, device: torch.device) -> dict[str, torch.Tensor]:
        """Examples ``start .. start + size - 1`` as one micro-batch of rows (pairs: 2 * size rows,
        chosen and rejected interleaved)."""
        items = [self[index] for index in range(start, start + size)]
        return {key: torch.cat([item[key] for item in items]).to(device, non_blocking=True) for key in items[0]}


def build_preference_datasets(prefixes: list[str], seq_len: int, num_samples: dict[str, int], seed: int,
                              split) -> dict[str, PreferenceDataset]:
    """One ``PreferenceDataset`` per split of ``num_samples`` over the stores ``prefixes`` (all of
    one kind, scored stores with the same attributes), taken in order."""
    stores = [PreferenceStore(prefix) for prefix in prefixes]
    for prefix, store in zip(prefixes[1:], stores[1:]):
        if (store.kind, store.attributes) != (stores[0].kind, stores[0].attributes):
            raise DataError(f"data.prefixes: {prefix} holds {store.kind} {store.attributes} but {prefixes[0]} holds "
                            f"{stores[0].kind} {stores[0].attributes}; train on stores of one kind and attributes.")
    return {name: PreferenceDataset(stores, seq_len, count, seed, split, name) for name, count in num_samples.items()}


__all__ = ["PAIRS", "SCORES", "PreferenceDataset", "PreferencePreprocessResult", "PreferenceStore",
           "build_preference_datasets", "final_reply_segments", "parse_example", "preference_kind",
           "preprocess_preference", "read_examples", "scores_path"]
