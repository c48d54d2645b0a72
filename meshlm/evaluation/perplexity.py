"""Perplexity and bits per byte of held-out text.

The text is one stream of tokens x_1 .. x_N: a token store's tokens as training reads them
(documents back to back, ``meshlm/data/indexed.py``), or text files tokenized as ``meshlm
preprocess`` tokenizes them (``--append-eos`` ends each document with the end-of-text token).
The stream is cut into non-overlapping windows of ``seq_len`` predictions: window k reads
x[kL+1 .. kL+L] and predicts x[kL+2 .. kL+L+1], so every token but the first is predicted
exactly once, from the tokens of its own window (the context restarts at each window, as in
training). Then, over the T = N - 1 predicted tokens,

    loss        = -(1/T) sum_t log p(x_t | window before t)       nats per token
    perplexity  = exp(loss)
    bits/byte   = T * loss / (ln 2 * B)                           B = UTF-8 bytes of the text

Perplexity depends on the tokenizer (a coarser one has fewer, harder tokens); bits per byte
does not, so it compares models with different vocabularies. B is the byte count of the text
files' documents, or, for a token store, of its documents decoded by the tokenizer (special
tokens such as end-of-text decode to no bytes); without a tokenizer a store's bits per byte
is not reported.

Under torchrun, window k is scored by data-parallel rank k mod dp (and a store's documents are
decoded the same way); the sums of nats, tokens and bytes are added over the ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from meshlm.data.indexed import TokenStore, store_paths
from meshlm.data.readers import expand_inputs, read_documents
from meshlm.errors import DataError
from meshlm.evaluation.loading import EvaluationModel
from meshlm.evaluation.scoring import label_logprobs
from meshlm.models.losses import IGNORE_INDEX
from meshlm.parallel.plain_collectives import all_reduce_

ENCODE_BATCH_DOCUMENTS = 256


@dataclass
class TokenSource:
    name: str
    """The prefix or file as the user gave it."""
    tokens: np.ndarray
    """The whole stream (memory-mapped for a token store)."""
    document_offsets: np.ndarray
    """Document d is tokens[offsets[d]:offsets[d + 1]] (for counting a store's bytes)."""
    text_bytes: int | None = None
    """UTF-8 bytes of the text, when the source was text (a store's are counted by decoding)."""


@dataclass
class PerplexityResult:
    name: str
    tokens: int
    """Tokens predicted (every token of the stream but the first)."""
    nats: float
    """Summed negative log-likelihood of those tokens."""
    bytes: int | None
    """UTF-8 bytes of the text (None: a token store evaluated without a tokenizer)."""

    @property
    def loss(self) -> float:
        return self.nats / self.tokens

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)

    @property
    def bits_per_byte(self) -> float | None:
        return None if not self.bytes else self.nats / (math.log(2) * self.bytes)

    def to_dict(self) -> dict:
        return {"data": self.name, "tokens": self.tokens, "loss": self.loss, "perplexity": self.perplexity,
                "bits_per_byte": self.bits_per_byte, "bytes": self.bytes}

    def __add__(self, other: "PerplexityResult") -> "PerplexityResult":
        known = self.bytes is not None and other.bytes is not None
        return PerplexityResult("all", self.tokens + other.tokens, self.nats + other.nats,
                                self.bytes + other.bytes if known else None)


def open_sources(specs: list[str], tokenizer, text_key: str = "text", append_eos: bool = False,
                 txt_documents: str = "paragraph") -> list[TokenSource]:
    """Each ``--data`` entry: a token store prefix (``PREFIX.bin`` + ``PREFIX.idx``), or text
    files (``.txt``/``.jsonl``/``.parquet``, or a directory of them), tokenized here."""
    sources = []
    for spec in specs:
        prefix = spec[:-4] if spec.endswith((".bin", ".idx")) else spec
        if any(path.is_file() for path in store_paths(prefix)):
            sources.append(store_source(spec, TokenStore(prefix)))
            continue
        if not Path(spec).exists():
            raise DataError(f"{spec}: no such token store ({prefix}.bin + {prefix}.idx) or text file; pass a "
                            "prefix written by `meshlm preprocess`, or a .txt/.jsonl/.json/.parquet file.")
        for path in expand_inputs([spec]):
            sources.append(text_source(path, tokenizer, text_key, append_eos, txt_documents))
    return sources


def store_source(name: str, store: TokenStore) -> TokenSource:
    return TokenSource(name, store.tokens, np.asarray(store.offsets))


def text_source(path: Path, tokenizer, text_key: str, append_eos: bool, txt_documents: str) -> TokenSource:
    """A text file's documents tokenized as ``meshlm preprocess`` does, and their UTF-8 bytes."""
    if tokenizer is None:
        raise DataError(f"{path}: text needs a tokenizer to be scored, and none was found beside the model; "
                        "pass --tokenizer PATH, or a token store written by `meshlm preprocess`.")
    if append_eos and tokenizer.eos_token_id is None:
        raise DataError(f"{tokenizer.source}: --append-eos needs an end-of-text token and this tokenizer names "
                        "none; drop --append-eos.")
    eos = [tokenizer.eos_token_id] if append_eos else []
    documents, lengths, text_bytes, batch = [], [], 0, []

    def encode(texts: list[str]) -> None:
        for ids in tokenizer.encode_batch(texts, add_special_tokens=False):
            documents.append(np.asarray(ids + eos, dtype=np.int64))
            lengths.append(len(ids) + len(eos))

    for text in read_documents(path, text_key, txt_documents=txt_documents):
        text_bytes += len(text.encode("utf-8"))
        batch.append(text)
        if len(batch) == ENCODE_BATCH_DOCUMENTS:
            encode(batch)
            batch = []
    encode(batch)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return TokenSource(str(path), np.concatenate(documents), offsets, text_bytes)


def check_tokens(source: TokenSource, vocab_size: int, seq_len: int) -> None:
    if len(source.tokens) < 2:
        raise DataError(f"{source.name}: holds {len(source.tokens)} token(s); perplexity needs at least 2 (one "
                        "to read, one to predict).")
    largest = int(source.tokens.max())
    if largest >= vocab_size:
        raise DataError(f"{source.name}: token id {largest} is outside the model's vocabulary [0, {vocab_size}); "
                        "the data was tokenized with another tokenizer than the model's.")
    if seq_len < 1:
        raise DataError(f"--seq-len {seq_len} must be at least 1 token.")


def decoded_bytes(source: TokenSource, tokenizer, rank: int, world: int) -> int:
    """UTF-8 bytes of this rank's share of the store's documents, decoded by ``tokenizer``."""
    offsets = source.document_offsets
    return sum(len(tokenizer.decode(source.tokens[offsets[d]:offsets[d + 1]].tolist()).encode("utf-8"))
               for d in range(rank, len(offsets) - 1, world))


def window_batch(tokens: np.ndarray, starts: list[int], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and labels [len(starts), seq_len] of the windows starting at ``starts`` (the last
    window of the stream may be shorter: its row is padded and the padding ignored)."""
    input_ids = torch.zeros(len(starts), seq_len, dtype=torch.long)
    labels = torch.full((len(starts), seq_len), IGNORE_INDEX, dtype=torch.long)
    for row, start in enumerate(starts):
        window = torch.from_numpy(np.asarray(tokens[start:start + seq_len + 1], dtype=np.int64))
        input_ids[row, :len(window) - 1] = window[:-1]
        labels[row, :len(window) - 1] = window[1:]
    width = max(min(seq_len, len(tokens) - 1 - start) for start in starts)
    return input_ids[:, :width], labels[:, :width]


def evaluate_source(evaluation: EvaluationModel, source: TokenSource, seq_len: int,
                    batch_size: int) -> PerplexityResult:
    """Loss, perplexity and bits per byte of one source (see the module docstring)."""
    model, device = evaluation.model, evaluation.device
    check_tokens(source, model.config.vocab_size, seq_len)
    rank, world = evaluation.work_rank
    predicted = len(source.tokens) - 1
    starts = list(range(rank * seq_len, predicted, world * seq_len))
    nats = torch.zeros((), dtype=torch.float64, device=device)
    for first in range(0, len(starts), batch_size):
        input_ids, labels = window_batch(source.tokens, starts[first:first + batch_size], seq_len)
        logprobs, _ = label_logprobs(model, input_ids.to(device), labels.to(device))
        nats -= logprobs.double().sum()
    decoding = source.text_bytes is None and evaluation.tokenizer is not None
    decoded = decoded_bytes(source, evaluation.tokenizer, rank, world) if decoding else 0
    totals = torch.stack([nats, torch.tensor(float(decoded), dtype=torch.float64, device=device)])
    all_reduce_(totals, evaluation.work_group)
    byte_count = int(round(float(totals[1]))) if decoding else source.text_bytes
    return PerplexityResult(source.name, predicted, float(totals[0]), byte_count)


def evaluate_perplexity(evaluation: EvaluationModel, sources: list[TokenSource], seq_len: int,
                        batch_size: int) -> list[PerplexityResult]:
    """One result per source, in order."""
    return [evaluate_source(evaluation, source, seq_len, batch_size) for source in sources]


__all__ = ["PerplexityResult", "TokenSource", "decoded_bytes", "evaluate_perplexity", "evaluate_source",
           "open_sources", "store_source", "text_source", "window_batch"]
