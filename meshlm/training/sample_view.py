"""``meshlm data show``: the samples a run trains on, as text, with what the loss counts marked.

    meshlm data show configs/tiny.yaml                      the first 2 samples of step 0
    meshlm data show sft.yaml --step 100 --count 4          4 samples of step 100
    meshlm data show configs/tiny.yaml --split valid --json one JSON object per sample

The samples are built exactly as the trainer builds them (``data_loading.build_training_data``:
the blend, the split, the packing and the seeded shuffle), so sample ``i`` here is sample ``i``
the trainer reads: step ``s`` reads samples ``[s * G, (s + 1) * G)`` of the global order, G =
``train.global_batch_size``, whatever the layout. This is the check that catches a data
pipeline's silent mistakes before they cost a run: a wrong ``--text-key``, a chat template that
trains on the user's turns, documents glued together without an end-of-text token, a blend
weighted the wrong way.

For each sample it says where the sample comes from -- the corpus, and the documents of that
store it packs (with the token a document is entered at when the sample starts inside it) or the
preference example and its row (chosen / rejected) -- and prints the tokens as text:

- tokens the loss does **not** count (a chat store's prompt turns, a preference row's context, a
  token after a document boundary with ``data.document_boundaries``, padding) are dimmed on a
  terminal, and written between ``«`` and ``»`` otherwise (``--no-color``, or output to a file);
- ``⟦document N⟧`` marks where the next document of the store begins inside the sample.

A token counts when it is the label of the position before it: the first token of a sample is
never a label, so it is always shown as not counted. ``--json`` gives the token ids and the flags
themselves, for scripts.
"""

from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import asdict, dataclass, field

import numpy as np

from meshlm.data.blend import BlendedDataset
from meshlm.data.preference import PAIRS, PreferenceDataset
from meshlm.data.tokenizer import load_tokenizer
from meshlm.errors import ConfigError
from meshlm.models.losses import IGNORE_INDEX
from meshlm.training.data_loading import build_training_data

DIM, RESET = "\x1b[2m", "\x1b[0m"
UNCOUNTED_OPEN, UNCOUNTED_CLOSE = "«", "»"


@dataclass
class RowView:
    """One row of a sample: its tokens, which of them the loss counts, and where documents begin."""
    tokens: list[int]
    counted: list[bool]
    document_starts: dict[int, int] = field(default_factory=dict)
    """Position in the row -> the store's document number that begins there."""
    name: str = ""
    """'chosen' / 'rejected' for preference rows."""


@dataclass
class SampleView:
    index: int
    """Sample index in the split's global order."""
    source: str
    """Where it comes from, in words."""
    rows: list[RowView]


def lm_sample(dataset: BlendedDataset, index: int) -> SampleView:
    """Sample ``index`` of a blend: its seq_len + 1 tokens, the documents it packs, the labels counted."""
    member = dataset.datasets[int(dataset.blend_index[index])]
    local = int(dataset.blend_sample_index[index])
    item, stream_index = member[local], int(member.shuffle_index[local])
    spans = member.stream_spans(stream_index)
    tokens = member.stream_sample(stream_index).astype(np.int64).tolist()
    counted = [False] + (item["labels"] != IGNORE_INDEX).tolist()
    offsets = np.asarray(member.store.offsets)
    documents, starts, position = [], {}, 0
    for number, (start, stop) in enumerate(spans):
        document = int(np.searchsorted(offsets, start, side="right") - 1)
        entered_at = start - int(offsets[document])
        documents.append(f"{document}" + (f" (from token {entered_at:,})" if entered_at else ""))
        if number > 0 and stop > start:
            starts[position] = document
        position += stop - start
    source = f"{member.store.prefix}, document{'s' if len(documents) > 1 else ''} {', '.join(documents)}"
    return SampleView(index, source, [RowView(tokens, counted, starts)])


def preference_sample(dataset: PreferenceDataset, index: int) -> SampleView:
    """Example ``index`` of a preference split: each row up to its last token, the reply counted."""
    number, example = (int(value) for value in dataset.examples[dataset.order[index]])
    item = dataset[index]
    names = ["chosen", "rejected"] if dataset.kind == PAIRS else ["reply"]
    rows = []
    for row, name in enumerate(names):
        last = int(item["last_index"][row])
        tokens = item["input_ids"][row, :last + 1].tolist()
        counted = [False] + (item["labels"][row, :last] != IGNORE_INDEX).tolist()
        rows.append(RowView(tokens, counted, name=name))
    source = f"{dataset.stores[number].store.prefix}, example {example}"
    if "scores" in item:
        source += f", scores {[round(value, 4) for value in item['scores'][0].tolist()]}"
    return SampleView(index, source, rows)


def view_samples(config, split: str, first: int, count: int) -> tuple[list[SampleView], object]:
    """(samples ``first .. first + count - 1`` of ``split``, the run's tokenizer or None)."""
    with contextlib.redirect_stdout(sys.stderr):  # build notes must not mix with --json on stdout
        data = build_training_data(config)
    dataset = data.train if split == "train" else data.valid
    if dataset is None:
        raise ConfigError("the run has no validation samples (train.eval_every=0); show --split train, or set "
                          "train.eval_every.")
    if not 0 <= first < len(dataset):
        last_step = (len(dataset) - 1) // config.train.global_batch_size
        raise ConfigError(f"sample {first:,} is outside the {split} split's {len(dataset):,} samples; pick a --sample "
                          f"below {len(dataset):,}" + (f" or a --step up to {last_step:,} (train.steps is "
                                                      f"{config.train.steps:,})." if split == "train" else "."))
    indices = range(first, min(first + count, len(dataset)))
    build = preference_sample if isinstance(dataset, PreferenceDataset) else lm_sample
    tokenizer = load_tokenizer(data.tokenizer_file) if data.tokenizer_file is not None else None
    return [build(dataset, index) for index in indices], tokenizer


def render_row(row: RowView, tokenizer, color: bool) -> str:
    """The row as text: uncounted runs dimmed (``color``) or between « », document starts marked."""
    decode = ((lambda ids: tokenizer.decode(ids, skip_special_tokens=False)) if tokenizer is not None
              else (lambda ids: " ".join(map(str, ids))))  # special tokens shown: an EOS between documents counts
    pieces, start = [], 0
    boundaries = sorted({0, len(row.tokens), *row.document_starts,
                         *(p for p in range(1, len(row.tokens)) if row.counted[p] != row.counted[p - 1])})
    for start, stop in zip(boundaries, boundaries[1:]):
        if start in row.document_starts:
            marker = f"⟦document {row.document_starts[start]}⟧"
            pieces.append(f"\x1b[1m{marker}{RESET}" if color else marker)
        text = decode(row.tokens[start:stop])
        if not row.counted[start]:
            text = f"{DIM}{text}{RESET}" if color else f"{UNCOUNTED_OPEN}{text}{UNCOUNTED_CLOSE}"
        pieces.append(text)
    return "".join(pieces)


def describe(sample: SampleView, global_batch_size: int, split: str) -> str:
    step, position = divmod(sample.index, global_batch_size)
    counted = sum(sum(row.counted) for row in sample.rows)
    tokens = sum(len(row.tokens) for row in sample.rows)
    where = f"step {step}, sample {position} of its {global_batch_size}" if split == "train" else split
    return (f"── sample {sample.index:,} ({where}) · {sample.source} · {tokens:,} tokens, "
            f"{counted:,} counted by the loss")


def print_samples(samples: list[SampleView], tokenizer, global_batch_size: int, split: str, color: bool,
                  as_json: bool, out=None) -> None:
    out = out or sys.stdout
    for sample in samples:
        if as_json:
            record = asdict(sample)
            for row in record["rows"]:
                row["document_starts"] = {str(key): value for key, value in row["document_starts"].items()}
                if tokenizer is not None:
                    row["text"] = tokenizer.decode(row["tokens"], skip_special_tokens=False)
            print(json.dumps(record), file=out)
            continue
        print(describe(sample, global_batch_size, split), file=out)
        for row in sample.rows:
            if row.name:
                print(f"[{row.name}]", file=out)
            print(render_row(row, tokenizer, color), file=out)
        print(file=out)


__all__ = ["RowView", "SampleView", "describe", "lm_sample", "preference_sample", "print_samples", "render_row",
           "view_samples"]
