"""Blending several corpora by weight, with exact proportions.

A training mix such as "70% prose, 30% code" is a list of token stores and weights. Drawing
the corpus of each sample at random would give the proportions only on average; instead,
like Megatron-LM's ``BlendedDataset`` (Shoeybi et al. 2019), we fix the sequence greedily: at
step ``i`` we take the corpus whose achieved count lags its target most,

    d_i = argmax_d ( w_d * (i + 1) - count_d ),

so after any number ``n`` of samples every corpus has had ``w_d * n`` of them up to rounding
(ties go to the earlier corpus). ``blend_index[i] = d_i`` and ``blend_sample_index[i]`` (how
many samples of ``d_i`` came before) are built once (a plain loop, about a second per million
samples: the greedy choice depends on every earlier one) and cached like the GPT indices; each
corpus is then a ``GPTDataset`` asked for exactly the number of samples the blend draws
from it.

A blend is described by a small file (``blend.json`` or ``.yaml``), paths relative to it::

    {"tokenizer": "tokenizer.json",
     "datasets": [{"prefix": "shakespeare", "weight": 0.7}, {"prefix": "python", "weight": 0.3}]}
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml

from meshlm.data.gpt_dataset import GPTDataset, SPLIT_NAMES, load_cached, save_cached, settings_hash
from meshlm.errors import DataError

BLEND_KINDS = ("blend_index", "blend_sample_index")


@dataclass
class Blend:
    """Token-store prefixes and their weights (normalized to sum to 1), plus the tokenizer."""
    prefixes: list[str]
    weights: list[float]
    tokenizer: str | None = None


def load_blend(path: str | os.PathLike) -> Blend:
    """Read a blend file (JSON, or YAML by suffix); relative paths are relative to the file."""
    path = Path(path)
    try:
        text = path.read_text()
        payload = yaml.safe_load(text) if path.suffix in (".yaml", ".yml") else json.loads(text)
    except OSError as error:
        raise DataError(f"{path}: cannot read the blend file ({error.strerror or error}).") from error
    except (json.JSONDecodeError, yaml.YAMLError) as error:
        raise DataError(f"{path}: not valid {'YAML' if path.suffix in ('.yaml', '.yml') else 'JSON'} "
                        f"({error}).") from error
    entries = payload.get("datasets") if isinstance(payload, dict) else None
    if not isinstance(entries, list) or not entries or not all(
            isinstance(entry, dict) and "prefix" in entry and "weight" in entry for entry in entries):
        raise DataError(f"{path}: expected {{\"datasets\": [{{\"prefix\": ..., \"weight\": ...}}, ...]}}.")
    tokenizer = payload.get("tokenizer")
    return Blend(prefixes=[str(path.parent / entry["prefix"]) for entry in entries],
                 weights=normalize_weights([entry["weight"] for entry in entries], str(path)),
                 tokenizer=None if tokenizer is None else str(path.parent / tokenizer))


def normalize_weights(weights: list[float], where: str = "blend") -> list[float]:
    try:
        weights = [float(weight) for weight in weights]
    except (TypeError, ValueError) as error:
        raise DataError(f"{where}: weights {weights!r} must be numbers.") from error
    if not weights or min(weights) <= 0:
        raise DataError(f"{where}: weights {weights!r} must all be positive; drop a corpus instead of "
                        "giving it weight 0.")
    return [weight / sum(weights) for weight in weights]


def build_blend_indices(weights: list[float], num_samples: int) -> dict[str, np.ndarray]:
    """The greedy blend order of the module docstring for ``num_samples`` samples."""
    counts = [0] * len(weights)
    corpora = range(len(weights))
    blend_index = np.empty(num_samples, dtype=np.int64)
    blend_sample_index = np.empty(num_samples, dtype=np.int64)
    for step in range(num_samples):
        lagging = max(corpora, key=lambda d: weights[d] * (step + 1) - counts[d])
        blend_index[step] = lagging
        blend_sample_index[step] = counts[lagging]
        counts[lagging] += 1
    return {"blend_index": blend_index, "blend_sample_index": blend_sample_index}


class BlendedDataset(torch.utils.data.Dataset):
    """``num_samples`` samples drawn from several ``GPTDataset`` in exact proportions."""

    def __init__(self, blend: Blend, seq_len: int, num_samples: int, seed: int = 1234,
                 split: str | list[float] = "1", split_name: str = "train",
                 shuffle: bool = True, cache_dir: str | os.PathLike | None = None,
                 document_boundaries: bool = False):
        if num_samples < 1:
            raise DataError(f"num_samples={num_samples} for the {split_name} blend must be at least 1.")
        weights = normalize_weights(blend.weights)
        cache_dir = Path(cache_dir) if cache_dir is not None else Path(blend.prefixes[0]).parent / "index_cache"
        name = f"blend.{settings_hash({'weights': weights, 'num_samples': num_samples})}"
        indices = load_cached(cache_dir, name, BLEND_KINDS)
        self.indices_were_built = indices is None
        if indices is None:
            indices = build_blend_indices(weights, num_samples)
            save_cached(cache_dir, name, indices)
        self.blend_index = indices["blend_index"]
        self.blend_sample_index = indices["blend_sample_index"]
        counts = np.bincount(self.blend_index, minlength=len(weights))
        # a corpus whose weight is too small to be drawn even once in num_samples is not opened
        self.datasets = [GPTDataset(prefix, seq_len, int(count), seed, split, split_name, shuffle, cache_dir,
                                    document_boundaries)
                         if count else None for prefix, count in zip(blend.prefixes, counts)]
        self.num_samples = num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} is outside this blend's {self.num_samples} samples.")
        return self.datasets[int(self.blend_index[index])][int(self.blend_sample_index[index])]

    def from_sample(self, start: int) -> torch.utils.data.Dataset:
        """The samples ``start, start + 1, ...``: resume the global order at ``start``."""
        return torch.utils.data.Subset(self, range(start, len(self)))


def build_datasets(blend: Blend | str | os.PathLike, seq_len: int, num_samples: dict[str, int],
                   seed: int = 1234, split: str | list[float] = "98,1,1",
                   cache_dir: str | os.PathLike | None = None,
                   document_boundaries: bool = False) -> dict[str, BlendedDataset]:
    """One ``BlendedDataset`` per split named in ``num_samples`` (e.g. ``{"train": 10000,
    "valid": 100}``); ``blend`` is a ``Blend`` or the path of a blend file. ``document_boundaries``:
    samples carry ``document_ids`` and ignore the labels at boundaries (``gpt_dataset.py``)."""
    blend = blend if isinstance(blend, Blend) else load_blend(blend)
    unknown = set(num_samples) - set(SPLIT_NAMES)
    if unknown:
        raise DataError(f"num_samples names unknown splits {sorted(unknown)}; use {', '.join(SPLIT_NAMES)}.")
    return {name: BlendedDataset(blend, seq_len, count, seed, split, name, cache_dir=cache_dir,
                                 document_boundaries=document_boundaries)
            for name, count in num_samples.items()}
