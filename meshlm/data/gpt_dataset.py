"""Training samples from a token store: fixed-length windows packed across documents.

A language model trains on sequences of ``seq_len`` tokens. Padding short documents to that
length wastes compute, so, as in GPT-2/3 and Megatron-LM's ``GPTDataset`` (Shoeybi et al.
2019), the documents are laid end to end in one long *token stream* and cut into windows:
sample ``k`` is tokens ``[k * seq_len, k * seq_len + seq_len + 1)`` of the stream, its input
the first ``seq_len`` tokens and its labels the last ``seq_len`` (the next token at every
position). Consecutive samples share one token, so every token of the stream is an input
exactly once. A window may span several documents; the EOS token that preprocessing appends
(``--append-eos``) tells the model where one ends.

**Document boundaries** (``document_boundaries=True``, ``data.document_boundaries``). The model can
instead keep the documents of a window apart: each sample then also carries ``document_ids``
[seq_len], the index (0, 1, 2, ...) of the document each input token belongs to, counted from the
window's first document. The model restricts attention to each document, restarts RoPE positions
and Mamba-2's conv and SSM state at every boundary (``meshlm/models/context.py``), and the label
rule at a boundary is: a token is never trained to predict the next document's first token --
``labels[t]`` is ignored (``IGNORE_INDEX``) where token t and token t + 1 lie in different
documents (so is the window's last label when token seq_len starts a new document). A window's
first document may begin mid-document; its positions then start at 0 where the window does.

**Loss masks** (chat stores, ``meshlm preprocess --chat``: ``TokenStore.loss_mask``). Only the
tokens the mask marks (an assistant's reply and its end-of-turn token) are learned: since
``labels[t]`` is token t + 1, it is kept only where token t + 1 is marked, and is ``IGNORE_INDEX``
elsewhere. The inputs are unchanged: the model still reads the whole conversation.

Three index arrays turn "sample i" into tokens on disk, built once with numpy and cached:

- ``document_index``: the order of documents in the stream. Each *epoch* is the split's
  documents in a fresh random order (seeded); as many epochs are concatenated as the
  requested number of samples needs.
- ``sample_index[k] = (p, o)``: stream sample ``k`` starts at token ``o`` of document
  ``document_index[p]``.
- ``shuffle_index``: a seeded shuffle of the samples, so consecutive training steps do not see
  neighbouring windows of the same document: the stream samples are cut into windows of about
  one epoch (at most ``SHUFFLE_WINDOW_LIMIT``) and each window is permuted by its own seeded
  generator. ``dataset[i]`` is stream sample ``shuffle_index[i]``; the trainer resumes exactly
  by asking for ``i`` onwards.

All three are *prefix-stable*: asking for more samples (a longer run, or a resumed run given
more ``train.steps``) appends to the order and never changes the samples before.

The train/valid/test *split* is by documents: ``split="98,1,1"`` gives the first 98% of the
store's documents to train, the next 1% to valid and the last 1% to test (contiguous ranges,
so the splits are disjoint; shuffle a sorted corpus before preprocessing).

The cache lives in ``index_cache/`` beside the data (or ``cache_dir``); a file's name holds a
hash of the store (sizes, modification times, header) and of every setting, so a change to
either builds new indices and an unchanged run loads the old ones (memory-mapped).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import numpy as np
import torch

from meshlm.data.indexed import TokenStore
from meshlm.errors import DataError

IGNORE_INDEX = -100
"""The label the loss skips: torch's ``cross_entropy`` default, the value of
``meshlm.models.losses.IGNORE_INDEX`` (data sits beside models, so it cannot import it; a test
checks the two agree)."""

SPLIT_NAMES = ("train", "valid", "test")
INDEX_FORMAT_VERSION = 2
INDEX_KINDS = ("document_index", "sample_index", "shuffle_index")


def parse_split(split: str | list[float]) -> list[float]:
    """``"98,1,1"`` (or ``[98, 1, 1]``) as fractions summing to 1; missing parts are 0."""
    try:
        parts = [float(part) for part in (split.split(",") if isinstance(split, str) else split)]
    except ValueError as error:
        raise DataError(f"split={split!r} must be comma-separated numbers such as '98,1,1'.") from error
    if not 1 <= len(parts) <= len(SPLIT_NAMES) or min(parts) < 0 or sum(parts) <= 0:
        raise DataError(f"split={split!r} must be 1 to 3 non-negative numbers (train,valid,test) with a "
                        "positive sum, such as '98,1,1'.")
    parts += [0.0] * (len(SPLIT_NAMES) - len(parts))
    return [part / sum(parts) for part in parts]


def split_document_range(num_documents: int, split: str | list[float], split_name: str) -> tuple[int, int]:
    """The documents [start, stop) of ``split_name`` under ``split``."""
    if split_name not in SPLIT_NAMES:
        raise DataError(f"split_name={split_name!r} must be one of {', '.join(SPLIT_NAMES)}.")
    bounds = np.round(np.concatenate([[0.0], np.cumsum(parse_split(split))]) * num_documents).astype(int)
    bounds[-1] = num_documents
    position = SPLIT_NAMES.index(split_name)
    return int(bounds[position]), int(bounds[position + 1])


SHUFFLE_WINDOW_LIMIT = 1 << 22
"""At most this many consecutive stream samples are shuffled together (32 MB of int64 index)."""


def shuffle_window(tokens_per_epoch: int, seq_len: int) -> int:
    """Samples shuffled together: about one epoch's worth, capped by ``SHUFFLE_WINDOW_LIMIT``."""
    return max(1, min(tokens_per_epoch // seq_len, SHUFFLE_WINDOW_LIMIT))


def build_indices(document_lengths: np.ndarray, documents: np.ndarray, seq_len: int, num_samples: int,
                  seed: int, shuffle: bool) -> dict[str, np.ndarray]:
    """The three index arrays (see the module docstring) for ``num_samples`` samples.

    Prefix-stable: the first n samples are the same whatever ``num_samples`` >= n is asked for,
    because epoch e's document order comes from its own generator (seed, e) and the samples are
    shuffled in whole windows of fixed size, window w by its own generator (seed, w). So a run
    given more steps (``train.steps``) on resume reads the same samples up to where it stopped.
    """
    tokens_per_epoch = int(document_lengths[documents].sum())
    window = shuffle_window(tokens_per_epoch, seq_len)
    num_windows = math.ceil(num_samples / window)
    stream_samples = num_windows * window  # whole windows, so the last window's order is stable too
    num_epochs = math.ceil((stream_samples * seq_len + 1) / tokens_per_epoch)
    epochs = [np.random.default_rng([seed, 0, epoch]).permutation(documents) if shuffle else documents
              for epoch in range(num_epochs)]
    document_index = np.concatenate(epochs).astype(np.int64)
    stream_ends = np.cumsum(document_lengths[document_index])
    sample_starts = np.arange(stream_samples, dtype=np.int64) * seq_len
    positions = np.searchsorted(stream_ends, sample_starts, side="right")
    document_starts = stream_ends[positions] - document_lengths[document_index[positions]]
    sample_index = np.stack([positions, sample_starts - document_starts], axis=1).astype(np.int64)
    if shuffle:
        shuffle_index = np.concatenate([w * window + np.random.default_rng([seed, 1, w]).permutation(window)
                                        for w in range(num_windows)])[:num_samples]
    else:
        shuffle_index = np.arange(num_samples)
    return {"document_index": document_index, "sample_index": sample_index,
            "shuffle_index": shuffle_index.astype(np.int64)}


class GPTDataset(torch.utils.data.Dataset):
    """``num_samples`` samples of ``seq_len`` tokens from one split of the token store ``prefix``.

    ``dataset[i]`` is ``{"input_ids": LongTensor[seq_len], "labels": LongTensor[seq_len]}``, plus
    ``"document_ids"`` LongTensor[seq_len] with ``document_boundaries`` (module docstring: the
    documents are kept apart, and the labels at boundaries are ignored).
    ``num_samples=None`` means one epoch's worth; ``shuffle=False`` keeps documents and samples
    in store order. ``indices_were_built`` tells whether this instance built its indices (True)
    or loaded them from the cache (False).
    """

    def __init__(self, prefix: str | os.PathLike | TokenStore, seq_len: int, num_samples: int | None = None,
                 seed: int = 1234, split: str | list[float] = "1", split_name: str = "train",
                 shuffle: bool = True, cache_dir: str | os.PathLike | None = None,
                 document_boundaries: bool = False):
        self.store = prefix if isinstance(prefix, TokenStore) else TokenStore(prefix)
        self.document_boundaries = document_boundaries
        if seq_len < 1:
            raise DataError(f"seq_len={seq_len} must be at least 1.")
        self.seq_len = seq_len
        self.split_name = split_name
        start, stop = split_document_range(len(self.store), split, split_name)
        self.documents = np.arange(start, stop, dtype=np.int64)
        lengths = self.store.document_lengths
        split_tokens = int(lengths[start:stop].sum())
        if split_tokens == 0:
            raise DataError(f"{self.store.idx_path}: the {split_name} split (documents {start}-{stop} of "
                            f"{len(self.store)}) holds no tokens; change the split {split!r} or add data.")
        self.num_samples = (split_tokens - 1) // seq_len if num_samples is None else int(num_samples)
        if self.num_samples < 1:
            raise DataError(f"{self.store.idx_path}: the {split_name} split holds {split_tokens} tokens, "
                            f"fewer than one sample of seq_len + 1 = {seq_len + 1}; lower seq_len or add data.")
        settings = {"version": INDEX_FORMAT_VERSION, "store": self.store.fingerprint(), "seq_len": seq_len,
                    "num_samples": self.num_samples, "seed": seed, "documents": [start, stop], "shuffle": shuffle}
        cache_dir = Path(cache_dir) if cache_dir is not None else Path(self.store.prefix).parent / "index_cache"
        name = f"{Path(self.store.prefix).name}.{split_name}.{settings_hash(settings)}"
        indices = load_cached(cache_dir, name, INDEX_KINDS)
        self.indices_were_built = indices is None
        if indices is None:
            indices = build_indices(np.asarray(lengths), self.documents, seq_len, self.num_samples, seed, shuffle)
            save_cached(cache_dir, name, indices)
        self.document_index = indices["document_index"]
        self.sample_index = indices["sample_index"]
        self.shuffle_index = indices["shuffle_index"]

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} is outside this dataset's {self.num_samples} samples.")
        spans = self.stream_spans(int(self.shuffle_index[index]))
        pieces = [self.store.tokens[start:stop] for start, stop in spans]
        tokens = torch.from_numpy(np.concatenate(pieces).astype(np.int64))
        sample = {"input_ids": tokens[:-1], "labels": tokens[1:]}
        if self.store.loss_mask is not None:
            trained = np.concatenate([self.store.loss_mask[start:stop] for start, stop in spans])
            sample["labels"] = sample["labels"].masked_fill(torch.from_numpy(trained[1:] == 0), IGNORE_INDEX)
        if self.document_boundaries:
            lengths = torch.tensor([len(piece) for piece in pieces])
            documents = torch.repeat_interleave(torch.arange(len(pieces)), lengths)  # of the seq_len + 1 tokens
            sample["labels"] = sample["labels"].masked_fill(documents[:-1] != documents[1:], IGNORE_INDEX)
            sample["document_ids"] = documents[:-1]
        return sample

    def stream_sample(self, k: int) -> np.ndarray:
        """The ``seq_len + 1`` tokens of sample ``k`` in stream (unshuffled) order."""
        return np.concatenate(self.stream_pieces(k))

    def stream_pieces(self, k: int) -> list[np.ndarray]:
        """``stream_sample(k)`` as one piece per document it touches (a piece may be empty)."""
        return [self.store.tokens[start:stop] for start, stop in self.stream_spans(k)]

    def stream_spans(self, k: int) -> list[tuple[int, int]]:
        """The pieces of ``stream_pieces(k)`` as [start, stop) positions in the store's token array."""
        position, offset = (int(value) for value in self.sample_index[k])
        spans, needed = [], self.seq_len + 1
        offsets = self.store.offsets
        while needed > 0:
            document = int(self.document_index[position])
            start = int(offsets[document]) + offset
            stop = min(start + needed, int(offsets[document + 1]))
            spans.append((start, stop))
            needed -= stop - start
            position, offset = position + 1, 0
        return spans

    def from_sample(self, start: int) -> torch.utils.data.Dataset:
        """The samples ``start, start + 1, ...``: resume the global order at ``start``."""
        return torch.utils.data.Subset(self, range(start, len(self)))


def settings_hash(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def load_cached(cache_dir: Path, name: str, kinds: tuple[str, ...]) -> dict[str, np.ndarray] | None:
    """The cached arrays ``name.KIND.npy`` (memory-mapped), or None if any is missing or unreadable."""
    paths = {kind: cache_dir / f"{name}.{kind}.npy" for kind in kinds}
    if not all(path.is_file() for path in paths.values()):
        return None
    try:
        return {kind: np.load(path, mmap_mode="r") for kind, path in paths.items()}
    except (OSError, ValueError):
        return None


def save_cached(cache_dir: Path, name: str, arrays: dict[str, np.ndarray]) -> None:
    """Write each array to ``name.KIND.npy`` under a temporary name, then rename."""
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        for kind, array in arrays.items():
            path = cache_dir / f"{name}.{kind}.npy"
            temporary = cache_dir / f"{name}.{kind}.{os.getpid()}.tmp.npy"
            np.save(temporary, array)
            os.replace(temporary, path)
    except OSError as error:
        raise DataError(f"{cache_dir}: cannot write the dataset index cache ({error.strerror or error}); "
                        "pass a writable cache_dir.") from error
