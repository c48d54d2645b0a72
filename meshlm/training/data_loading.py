"""From a run's ``data`` and ``train`` sections to the datasets the trainer reads.

The trainer needs two things from the data pipeline (``meshlm.data``):

- a **train** dataset whose item ``i`` is sample ``i`` of one fixed global order, a dict
  ``{"input_ids", "labels"}`` of ``seq_len`` tokens each (and ``"document_ids"`` with
  ``data.document_boundaries``: the model then keeps the packed documents apart). Step ``s`` reads samples
  ``[s * global_batch_size, (s + 1) * global_batch_size)``, so "samples consumed" in a
  checkpoint says exactly where a resumed run continues. With data parallelism the step's
  ``global_batch_size / micro_batch_size`` micro-batches are split into contiguous shares, DP
  rank d reading the d-th (the trainer's ``next_micro_batches``); every rank of a TP group
  reads the same share. The order itself never depends on the layout;
- a **valid** dataset of ``eval_batches * micro_batch_size`` samples, read from its start at
  every evaluation, so each validation loss is measured on the same sequences.

Both are ``BlendedDataset``s (``meshlm/data/blend.py``): the corpora come from a blend file
(``data.blend``, as written by ``meshlm data demo``) or from ``data.prefixes`` with
``data.weights`` (default: proportional to each store's size); when both are set the prefixes
win, with a warning (the configs set a blend by default, so a prefix given on the command line
would otherwise replace it silently). The train and valid parts are disjoint document ranges
of every store (``data.split``).

The tokenizer (copied into every checkpoint, so that ``meshlm generate`` can take text) is
``data.tokenizer``, else the blend file's, else the one the token stores were preprocessed
with (their ``PREFIX.meta.json``); stores made with different tokenizers are refused, since
the same id would mean different tokens.

**Chat stores** (``meshlm preprocess --chat``) carry a loss mask, so the loss counts the
assistant's tokens only (``meshlm/data/gpt_dataset.py``). Their conversations must not see each
other, so a run that reads one keeps documents apart even when ``data.document_boundaries`` is
false: it is turned on, with a one-line note (a conversation attending to the one packed before
it would learn from text it will never have at inference).

**Preference stores** (``meshlm preprocess --preference``) hold chosen/rejected pairs or rated
replies; ``train.objective=reward`` and ``dpo`` read them as padded rows, one example per sample,
never packed (``meshlm/training/preference_data.py``).

Before any step runs, the vocabulary is checked: every token store records the vocabulary
size its ids lie below, and the tokenizer knows its own; the model's embedding must cover
both, or the first batch would fail with an index error deep inside the embedding. An
embedding far larger than that (more than twice the ids, and more than padding them to a
multiple of ``VOCAB_PADDING_MULTIPLE`` needs) is allowed with a warning: its extra rows are
parameters and memory that no token ever trains.

**Reading ahead** (``BatchPrefetcher``). Gathering a step's samples (index lookups, memory-mapped
token slices, stacking) is host work that would otherwise sit between two steps with the device
idle. Since the order is a function of the sample index alone, the next step's micro-batches are
known in advance: while step s computes, a background thread reads those of step s + 1, into
page-locked ("pinned") memory when the run is on CUDA, so that the trainer's
``.to(device, non_blocking=True)`` is a DMA that does not hold up the host. A read is asked for by
its micro-batches' first sample indices, and ``take`` hands it out only for exactly those indices;
anything else (a checkpoint loaded, a data position moved) is read on the spot instead, so the
batches are the same, bit for bit, with or without the thread.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
import warnings
import zlib
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch

from meshlm.data.blend import Blend, build_datasets, load_blend
from meshlm.data.indexed import TokenStore, metadata_path
from meshlm.data.preference import preference_kind
from meshlm.data.tokenizer import load_tokenizer
from meshlm.errors import ConfigError, DataError
from meshlm.training.metrics import metric_word
from meshlm.training.preference_data import build_preference_data


VOCAB_PADDING_MULTIPLE = 128
"""Padding the vocabulary up to a multiple of this (for fast matmuls, Megatron-style) never warns."""


@dataclass
class TrainingData:
    train: torch.utils.data.Dataset
    """Sample i of the global training order at index i."""
    valid: torch.utils.data.Dataset | None
    """The fixed validation samples (None when train.eval_every is 0)."""
    tokenizer_file: Path | None
    """The tokenizer the data was built with (copied into every checkpoint), if known."""
    valid_per_dataset: dict[str, torch.utils.data.Dataset] = field(default_factory=dict)
    """train.eval_per_dataset: each corpus's own fixed validation samples, by name."""


def resolve_blend(data) -> Blend:
    """The corpora, weights and tokenizer named by a ``DataConfig``."""
    if data.prefixes:
        if data.blend:
            warnings.warn(f"data.prefixes and data.blend={data.blend} are both set: training reads data.prefixes "
                          "and ignores the blend file; set data.blend=null to silence this.", stacklevel=2)
        sizes = [TokenStore(prefix).num_tokens for prefix in data.prefixes]
        weights = data.weights if data.weights is not None else [max(size, 1) for size in sizes]
        blend = Blend(prefixes=list(data.prefixes), weights=list(weights), tokenizer=None)
    elif data.blend:
        if not Path(data.blend).is_file():
            raise DataError(f"data.blend={data.blend}: no such blend file; run `meshlm data demo` to create the "
                            "demo data, or point data.blend (or data.prefixes) at your own token stores.")
        blend = load_blend(data.blend)
    else:
        raise ConfigError("the run has no data: set data.blend to a blend file or data.prefixes to token stores.")
    if data.tokenizer is not None:
        blend.tokenizer = data.tokenizer
    elif blend.tokenizer is None:
        blend.tokenizer = tokenizer_of_stores(blend.prefixes)
    return blend


def tokenizer_of_stores(prefixes: list[str]) -> str | None:
    """The tokenizer file the token stores' metadata names (``meshlm preprocess`` records it);
    None when no store names one, with a warning when the one named is gone."""
    named: dict[str, list[str]] = {}  # tokenizer file -> the stores made with it
    for prefix in prefixes:
        tokenizer = TokenStore(prefix).recorded_tokenizer()
        if tokenizer is None:
            continue
        if not tokenizer.is_file():
            warnings.warn(f"{metadata_path(prefix)} names the tokenizer {tokenizer}, which no longer exists, so this "
                          "run's checkpoints carry no tokenizer; set data.tokenizer to the tokenizer file.",
                          stacklevel=3)
            continue
        named.setdefault(str(tokenizer), []).append(prefix)
    by_content: dict[int, str] = {}  # the same file copied elsewhere is the same tokenizer
    for tokenizer in named:
        by_content.setdefault(zlib.crc32(Path(tokenizer).read_bytes()), tokenizer)
    if len(by_content) > 1:
        first, second = list(by_content.values())[:2]
        raise DataError(f"data.prefixes: {named[first][0]} was preprocessed with the tokenizer {first} and "
                        f"{named[second][0]} with {second}, which differ, so their token ids mean different things; "
                        "preprocess every store with one tokenizer (or set data.tokenizer if they agree).")
    return next(iter(by_content.values()), None)


def check_vocabulary(blend: Blend, vocab_size: int) -> None:
    """Raise ConfigError when token ids of the data or the tokenizer fall outside the model's
    vocabulary; warn when the vocabulary is far larger than they need (module docstring)."""
    sources = [(f"{TokenStore(prefix).idx_path} (token store)", TokenStore(prefix).vocab_size)
               for prefix in blend.prefixes]
    if blend.tokenizer is not None:
        sources.append((f"{blend.tokenizer} (tokenizer)", load_tokenizer(blend.tokenizer).vocab_size))
    for source, needed in sources:
        if needed > vocab_size:
            raise ConfigError(f"model.vocab_size={vocab_size} is smaller than the vocabulary of {source}, which "
                              f"has {needed} ids; set model.vocab_size={needed} (or a larger padded size).")
    source, needed = max(sources, key=lambda pair: pair[1])
    padded = -(-needed // VOCAB_PADDING_MULTIPLE) * VOCAB_PADDING_MULTIPLE
    if vocab_size > max(2 * needed, padded):
        warnings.warn(f"model.vocab_size={vocab_size} is more than twice the {needed} ids of {source}: the other "
                      f"{vocab_size - needed} embedding rows are never trained; set model.vocab_size={padded} "
                      f"(padded to a multiple of {VOCAB_PADDING_MULTIPLE}) unless that is intended.", stacklevel=3)


def build_training_data(config) -> TrainingData:
    """The train and valid datasets of a ``RunConfig``, with the vocabulary checked."""
    data, train = config.data, config.train
    blend = resolve_blend(data)
    check_vocabulary(blend, config.model.vocab_size)
    tokenizer_file = Path(blend.tokenizer) if blend.tokenizer is not None else None
    if train.objective != "lm" or any(preference_kind(prefix) for prefix in blend.prefixes):
        datasets = build_preference_data(config, blend.prefixes)  # reward models, DPO (preference_data.py)
        return TrainingData(train=datasets["train"], valid=datasets.get("valid"), tokenizer_file=tokenizer_file)
    num_samples = {"train": train.steps * train.global_batch_size}
    if train.eval_every > 0:
        num_samples["valid"] = train.eval_batches * train.micro_batch_size
    document_boundaries = data.document_boundaries
    chat_stores = [prefix for prefix in blend.prefixes if TokenStore(prefix).loss_mask is not None]
    if chat_stores and not document_boundaries:
        print(f"note: {chat_stores[0]} is a chat store (loss mask), so data.document_boundaries is turned on: "
              "each conversation is kept apart from those packed beside it.", flush=True)
        document_boundaries = True
    datasets = build_datasets(blend, train.seq_len, num_samples, seed=train.seed, split=data.split,
                              cache_dir=data.cache_dir, document_boundaries=document_boundaries)
    per_dataset = {}
    if train.eval_per_dataset and "valid" in num_samples:
        for name, prefix in dataset_names(blend.prefixes).items():
            alone = Blend(prefixes=[prefix], weights=[1.0], tokenizer=blend.tokenizer)
            per_dataset[name] = build_datasets(alone, train.seq_len, {"valid": num_samples["valid"]}, seed=train.seed,
                                               split=data.split, cache_dir=data.cache_dir,
                                               document_boundaries=document_boundaries)["valid"]
    return TrainingData(train=datasets["train"], valid=datasets.get("valid"), valid_per_dataset=per_dataset,
                        tokenizer_file=Path(blend.tokenizer) if blend.tokenizer is not None else None)


def dataset_names(prefixes: list[str]) -> dict[str, str]:
    """A metric-safe name for each store of a blend: its file name, numbered where two are the same."""
    names: dict[str, str] = {}
    for prefix in prefixes:
        base = metric_word(Path(prefix).name)
        name, count = base, 1
        while name in names:
            count += 1
            name = f"{base}_{count}"
        names[name] = prefix
    return names


def read_batch(dataset: torch.utils.data.Dataset, start: int, size: int,
               device: torch.device) -> dict[str, torch.Tensor]:
    """Samples ``start .. start + size - 1`` of ``dataset``, stacked into [size, seq_len] tensors:
    ``input_ids``, ``labels`` and, with ``data.document_boundaries``, ``document_ids``. A dataset
    with rows of its own (preference pairs: meshlm/data/preference.py) reads them itself."""
    if hasattr(dataset, "read_batch"):
        return dataset.read_batch(start, size, device)
    samples = [dataset[index] for index in range(start, start + size)]
    keys = [key for key in ("input_ids", "labels", "document_ids") if key in samples[0]]
    return {key: torch.stack([sample[key] for sample in samples]).to(device, non_blocking=True) for key in keys}


@dataclass(frozen=True)
class BatchRead:
    """One read of micro-batches, as ``BatchPrefetcher.reads`` records it (tests, timelines)."""
    first_samples: tuple[int, ...]
    thread: str
    """Name of the thread that read them: ``BatchPrefetcher.THREAD_NAME`` when read ahead."""
    started: float
    finished: float
    """``time.perf_counter()`` seconds."""


class BatchPrefetcher:
    """Micro-batches of ``micro_batch_size`` samples read ahead in one background daemon thread.

    ``prefetch(firsts)`` queues the read of the micro-batches starting at samples ``firsts``;
    ``take(firsts)`` returns them (on the host, pinned when ``pin_memory``), from the read ahead
    when it was for the same ``firsts``, else read in the calling thread. ``background=False``
    reads everything on the spot. ``close()`` stops the thread; the thread is a daemon, so even a
    prefetcher never closed cannot keep the process alive.
    """

    THREAD_NAME = "meshlm-batch-prefetch"

    def __init__(self, dataset: torch.utils.data.Dataset, micro_batch_size: int, pin_memory: bool = False,
                 background: bool = True):
        self.dataset, self.micro_batch_size = dataset, micro_batch_size
        self.pin_memory, self.background = pin_memory, background  # pin only on CUDA runs: it needs a driver
        self.requests: queue.Queue = queue.Queue()
        self.pending: tuple[tuple[int, ...], Future] | None = None
        self.thread: threading.Thread | None = None
        self.reads: collections.deque[BatchRead] = collections.deque(maxlen=64)

    def read(self, firsts) -> list[dict[str, torch.Tensor]]:
        started = time.perf_counter()
        batches = [read_batch(self.dataset, first, self.micro_batch_size, torch.device("cpu")) for first in firsts]
        if self.pin_memory:
            batches = [{key: value.pin_memory() for key, value in batch.items()} for batch in batches]
        self.reads.append(BatchRead(tuple(firsts), threading.current_thread().name, started, time.perf_counter()))
        return batches

    def prefetch(self, firsts) -> None:
        """Start reading the micro-batches that begin at samples ``firsts`` in the background."""
        if not self.background:
            return
        if self.thread is None:
            self.thread = threading.Thread(target=self._serve, name=self.THREAD_NAME, daemon=True)
            self.thread.start()
        self.pending = (tuple(firsts), Future())
        self.requests.put(self.pending)

    def take(self, firsts) -> list[dict[str, torch.Tensor]]:
        """The micro-batches that begin at samples ``firsts``: the read ahead if it is theirs."""
        pending, self.pending = self.pending, None
        if pending is not None and pending[0] == tuple(firsts):
            return pending[1].result()  # re-raises a failed read here, in the trainer's thread
        return self.read(firsts)  # nothing read ahead, or for another data position: read now

    def close(self) -> None:
        """Stop the background thread (after the read it is doing, if any)."""
        self.pending = None
        if self.thread is not None:
            self.requests.put(None)
            self.thread.join(timeout=60)
            self.thread = None

    def _serve(self) -> None:
        while (request := self.requests.get()) is not None:
            firsts, future = request
            try:
                future.set_result(self.read(firsts))
            except BaseException as error:  # handed to take(); a read nobody takes is dropped
                future.set_exception(error)


__all__ = ["BatchPrefetcher", "BatchRead", "TrainingData", "VOCAB_PADDING_MULTIPLE", "build_training_data",
           "check_vocabulary", "read_batch", "resolve_blend", "tokenizer_of_stores"]
