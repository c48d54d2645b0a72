"""Preprocessing: tokenize a corpus once into a token store (``PREFIX.bin`` + ``PREFIX.idx``).

    meshlm preprocess --input data/*.jsonl --tokenizer tokenizer.json --out data/corpus \\
        --workers 8 --append-eos

The corpus is streamed: the parent process reads documents (``readers``) and groups them in
batches that never cross a file, worker processes tokenize the batches, and the parent
appends their tokens to the store (``indexed.TokenStoreWriter``) in the order the batches
were read. At most ``2 * workers`` batches are in flight at once, so memory stays flat
however large the input is, and the store is byte-for-byte the same for any ``--workers``.
(``Pool.imap`` would keep the order too, but it reads its input as fast as it can, with no
bound on how far ahead; ``apply_async`` with a bounded queue gives the same order with a
bound.)

With ``--append-eos`` every document ends with the tokenizer's end-of-sequence token, the
document separator a packed training sample sees (Megatron's ``--append-eod``). A ``.txt``
file is cut into documents at blank lines (``--txt-documents paragraph``, the default) or
is one document (``--txt-documents file``). Progress goes to stderr: a ``tqdm`` bar when
tqdm is installed, otherwise one plain line.

With ``--chat`` the input is conversations (JSONL ``messages``), rendered by a chat template
and stored with a loss mask: ``meshlm/data/chat_preprocess.py``. With ``--preference`` it is
preference pairs or rated replies for reward models and DPO: ``meshlm/data/preference.py``.

The store's ``PREFIX.meta.json`` records the tokenizer (its path relative to the store) and
these settings, so a run trained from ``data.prefixes`` finds the tokenizer and copies it into
its checkpoints without being told (``meshlm/training/data_loading.py``).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from collections import deque
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from meshlm.data.indexed import TokenStoreWriter
from meshlm.data.readers import TXT_DOCUMENT_MODES, check_txt_documents, expand_inputs, read_documents
from meshlm.data.tokenizer import find_tokenizer_file, load_tokenizer
from meshlm.errors import DataError

BATCH_DOCUMENTS = 512
BATCH_CHARACTERS = 2_000_000


@dataclass
class Batch:
    """Consecutive documents of one input file; ``first_document`` counts from 1 in that file."""
    source: str
    first_document: int
    texts: list[str]


@dataclass
class PreprocessResult:
    prefix: str
    num_documents: int
    num_tokens: int


def preprocess(inputs: Iterable[str | os.PathLike], tokenizer_path: str | os.PathLike,
               out_prefix: str | os.PathLike, workers: int = 1, text_key: str = "text",
               append_eos: bool = False, show_progress: bool = True,
               txt_documents: str = "paragraph") -> PreprocessResult:
    """Tokenize the documents of ``inputs`` into the token store ``out_prefix``."""
    files = expand_inputs(inputs)
    tokenizer = load_tokenizer(tokenizer_path)
    if append_eos and tokenizer.eos_token_id is None:
        raise DataError(f"{tokenizer_path}: --append-eos needs an end-of-sequence token, and this tokenizer "
                        "names none; add eos_token to its tokenizer_config.json or drop --append-eos.")
    if workers < 1:
        raise DataError(f"--workers {workers} must be at least 1.")
    check_txt_documents(txt_documents)
    metadata = store_metadata(tokenizer_path, out_prefix, tokenizer.vocab_size, append_eos, text_key, txt_documents)
    progress = Progress(sum(path.stat().st_size for path in files), enabled=show_progress)
    batches = document_batches(files, text_key, progress.add_bytes, txt_documents=txt_documents)
    encoded = ordered_map(encode_batch, batches, workers, initialize_worker, (str(tokenizer_path), append_eos))
    try:
        with TokenStoreWriter(out_prefix, tokenizer.vocab_size, metadata) as writer:
            for source, tokens, lengths in encoded:
                writer.add_documents(tokens, lengths, source=source)
                progress.add_counts(len(lengths), tokens.size)
    finally:
        progress.close()  # end the progress line, also before an error message
    return PreprocessResult(str(out_prefix), writer.num_documents, writer.num_tokens)


def store_metadata(tokenizer_path: str | os.PathLike, out_prefix: str | os.PathLike, vocab_size: int,
                   append_eos: bool, text_key: str, txt_documents: str) -> dict:
    """What ``PREFIX.meta.json`` records: the tokenizer file, relative to the store's folder
    (as a blend file's paths are, so the two can move together), and the settings used."""
    tokenizer_file = os.path.abspath(find_tokenizer_file(tokenizer_path))  # abspath: keep symlinks as named
    store_folder = os.path.dirname(os.path.abspath(f"{out_prefix}.meta.json"))
    return {"tokenizer": os.path.relpath(tokenizer_file, store_folder), "tokenizer_vocab_size": vocab_size,
            "append_eos": append_eos, "text_key": text_key, "txt_documents": txt_documents}


def document_batches(files: list[Path], text_key: str, on_bytes: Callable[[int], None],
                     max_documents: int = BATCH_DOCUMENTS, max_characters: int = BATCH_CHARACTERS,
                     txt_documents: str = "paragraph") -> Iterator[Batch]:
    """Documents grouped in batches of at most ``max_documents`` / about ``max_characters``."""
    for path in files:
        batch = Batch(str(path), 1, [])
        characters = 0
        for text in read_documents(path, text_key, on_bytes, txt_documents):
            batch.texts.append(text)
            characters += len(text)
            if len(batch.texts) >= max_documents or characters >= max_characters:
                yield batch
                batch = Batch(str(path), batch.first_document + len(batch.texts), [])
                characters = 0
        if batch.texts:
            yield batch


# --- the worker side: one tokenizer per process, loaded once ------------------------------------
_worker_state: dict = {}


def initialize_worker(tokenizer_path: str, append_eos: bool) -> None:
    if multiprocessing.parent_process() is not None:
        # one process per core already; a forked child must not start the Rust thread pool
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tokenizer = load_tokenizer(tokenizer_path)
    _worker_state.update(tokenizer=tokenizer, eos=[tokenizer.eos_token_id] if append_eos else [])


def encode_batch(batch: Batch) -> tuple[str, np.ndarray, np.ndarray]:
    """(description of the source, all tokens back to back as uint32, tokens per document)."""
    tokenizer, eos = _worker_state["tokenizer"], _worker_state["eos"]
    token_lists = [ids + eos for ids in tokenizer.encode_batch(batch.texts, add_special_tokens=False)]
    lengths = np.fromiter(map(len, token_lists), dtype=np.int64, count=len(token_lists))
    tokens = np.fromiter(chain.from_iterable(token_lists), dtype=np.uint32, count=int(lengths.sum()))
    last = batch.first_document + len(batch.texts) - 1
    return f"{batch.source} (documents {batch.first_document}-{last})", tokens, lengths


def ordered_map(function: Callable, tasks: Iterable, workers: int, initializer: Callable,
                initargs: tuple, max_in_flight_per_worker: int = 2) -> Iterator:
    """``function(task)`` for each task, in task order, on ``workers`` processes, with at most
    ``workers * max_in_flight_per_worker`` tasks read ahead. One worker runs in this process."""
    if workers == 1:
        initializer(*initargs)
        yield from map(function, tasks)
        return
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    with multiprocessing.get_context(method).Pool(workers, initializer, initargs) as pool:
        pending: deque = deque()
        for task in tasks:
            pending.append(pool.apply_async(function, (task,)))
            if len(pending) >= workers * max_in_flight_per_worker:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


class Progress:
    """Bytes read, documents and tokens written, on stderr: tqdm if installed, else one line."""

    def __init__(self, total_bytes: int, enabled: bool = True, interval_s: float = 0.5):
        self.total_bytes, self.enabled, self.interval_s = total_bytes, enabled, interval_s
        self.bytes_read = self.documents = self.tokens = 0
        self.start = self.last_draw = time.monotonic()
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, file=sys.stderr, desc="preprocess")
            except ImportError:
                pass

    def add_bytes(self, count: int) -> None:
        self.bytes_read += count
        if self.bar is not None:
            self.bar.update(count)

    def add_counts(self, documents: int, tokens: int) -> None:
        self.documents += documents
        self.tokens += tokens
        now = time.monotonic()
        if self.enabled and now - self.last_draw >= self.interval_s:
            self.last_draw = now
            self.draw()

    def draw(self) -> None:
        counts = f"{self.documents:,} documents, {self.tokens:,} tokens"
        if self.bar is not None:
            self.bar.set_postfix_str(counts, refresh=True)
            return
        percent = 100.0 * self.bytes_read / max(self.total_bytes, 1)
        rate = self.bytes_read / max(time.monotonic() - self.start, 1e-9) / 1e6
        print(f"\rpreprocess: {percent:5.1f}% of {self.total_bytes / 1e6:,.1f} MB, {counts}, {rate:,.1f} MB/s",
              end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if not self.enabled:
            return
        self.draw()
        if self.bar is not None:
            self.bar.close()
        else:
            print(file=sys.stderr)


# --- command line ----------------------------------------------------------------------------
def add_arguments(parser) -> None:
    parser.add_argument("--input", nargs="+", required=True, metavar="FILE",
                        help=".jsonl, .json, .txt (see --txt-documents), .parquet or .arrow files, or directories; "
                             "text files may be compressed (.gz, .bz2, .xz, .zst)")
    parser.add_argument("--tokenizer", required=True,
                        help="tokenizer file or directory (recorded in PREFIX.meta.json, so training finds it)")
    parser.add_argument("--out", required=True, metavar="PREFIX",
                        help="writes PREFIX.bin, PREFIX.idx and PREFIX.meta.json")
    parser.add_argument("--txt-documents", choices=TXT_DOCUMENT_MODES, default="paragraph",
                        help="how a .txt file is cut into documents: 'paragraph' (the default: a new document "
                             "after every blank line) or 'file' (the whole file is one document, e.g. source code)")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1)")
    parser.add_argument("--text-key", default="text", help="JSON key / Parquet column of the text")
    parser.add_argument("--append-eos", action="store_true", help="end every document with the EOS token")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--chat", action="store_true",
                        help="the input is chat JSONL ({\"messages\": [...]} per line, or ShareGPT, Alpaca or "
                             "prompt/completion records): render it with the chat template and store a loss mask "
                             "(PREFIX.mask.bin) that trains on assistant turns only")
    parser.add_argument("--preference", action="store_true",
                        help="the input is preference JSONL (prompt/messages + chosen + rejected, or messages + "
                             "scores per line) for reward models and DPO: meshlm/data/preference.py")
    parser.add_argument("--max-vocab-size", type=int, metavar="N",
                        help="with --chat or --preference: refuse to add chat tokens to the tokenizer beyond N ids (the model's "
                             "vocab_size)")


def run(args) -> int:
    if args.preference:
        from meshlm.data.preference import preprocess_preference
        result = preprocess_preference(args.input, args.tokenizer, args.out, max_vocab_size=args.max_vocab_size)
        print(f"wrote the preference store {result.prefix} ({result.kind}): {result.num_examples:,} examples, "
              f"{result.num_tokens:,} tokens" + (f"; attributes {', '.join(result.attributes)}" if result.attributes
                                                 else ""))
        return 0
    if args.chat:
        from meshlm.data.chat_preprocess import chat_tokenizer_folder, preprocess_chat
        result = preprocess_chat(args.input, args.tokenizer, args.out, max_vocab_size=args.max_vocab_size)
        print(f"wrote {result.prefix}.bin, .idx, .mask.bin, .meta.json and {chat_tokenizer_folder(result.prefix)}/: "
              f"{result.num_documents:,} conversations, {result.num_tokens:,} tokens")
        return 0
    result = preprocess(args.input, args.tokenizer, args.out, workers=args.workers, text_key=args.text_key,
                        append_eos=args.append_eos, show_progress=not args.no_progress,
                        txt_documents=args.txt_documents)
    print(f"wrote {result.prefix}.bin, .idx and .meta.json: {result.num_documents:,} documents, "
          f"{result.num_tokens:,} tokens")
    return 0
