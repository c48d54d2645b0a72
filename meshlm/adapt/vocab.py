"""Vocabulary adaptation: give a trained model the rows of an extended tokenizer's new tokens.

ChipNeMo (Liu et al. 2023, "ChipNeMo: Domain-Adapted LLMs for Chip Design") extends a general
tokenizer with domain tokens (``meshlm tokenizer extend``, meshlm/data/tokenizer_extension.py)
and then continues pretraining on domain data. The model needs an embedding row (and an output
row, when the head is not tied to the embedding) for every new id, initialized so that the
adapted model starts where the old one was:

- **Old rows are copied unchanged**, and nothing else in the model depends on the vocabulary,
  so on text made of old tokens every hidden state is the old model's and the logit of every old
  token at every position is exactly the old one. The new tokens' logits are added to the
  softmax, so they take some probability mass from the old ones (and training decides how much).
- **A new token's row is the mean of the rows of its base pieces**, the base-tokenizer ids it
  stands for (``base_pieces``: the pieces its BPE merges join, e.g. 'Ġisinstance' = 'Ġis' +
  'inst' + 'ance'). As an input the new token then starts near what the model saw for those
  pieces; as an output its logit starts at the mean of theirs, a fair guess at how likely the
  whole word is. ChipNeMo initializes new embeddings the same way (from the general tokenizer's
  pieces) rather than at random, which their ablation shows converges faster.

**Vocabulary size.** A model's vocab_size may exceed its tokenizer's (rows padded to a multiple
of 128, say). Those spare rows never held a token -- no id of the base tokenizer points at them,
so they were never an input and only ever a wrong answer -- and the new tokens may take them:
when the extended tokenizer fits in the model's rows, vocab_size stays and the spare rows of the
new ids are overwritten (the rows past it stay as they were). Otherwise the vocabulary grows to
the extended tokenizer's size, rounded up to ``pad_to_multiple`` (by default 128 when the
model's vocab_size was a multiple of 128, else 1); rows of the padding it adds start as the
mean of the base tokens' rows.

``vocab_plan`` describes the adapted model as a plan, {name: PlannedTensor}, that reads each
source tensor when it is written (``meshlm adapt-vocab`` streams it to disk, holding one tensor
at a time); ``adapt_vocab_model`` builds the same model in memory.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch

from meshlm.checkpoint.model_files import expected_shapes, load_state_checked
from meshlm.checkpoint.safetensors_stream import PlannedTensor
from meshlm.errors import CheckpointError
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel

PAD_MULTIPLE = 128
"""The padding ``new_vocab_size`` keeps when the model's vocab_size was a multiple of it."""
VOCAB_TENSORS = ("embedding.weight", "output.weight")
"""The tensors with one row per token id; nothing else in a model depends on the vocabulary."""


def new_vocab_size(model_vocab_size: int, needed: int, pad_to_multiple: int | None = None) -> int:
    """The adapted model's vocab_size: unchanged when ``needed`` ids fit in its rows, else
    ``needed`` rounded up to ``pad_to_multiple`` (default: 128 if the model's size is a multiple of 128)."""
    if needed <= model_vocab_size:
        return model_vocab_size
    if pad_to_multiple is None:
        pad_to_multiple = PAD_MULTIPLE if model_vocab_size % PAD_MULTIPLE == 0 else 1
    return -(-needed // pad_to_multiple) * pad_to_multiple


def resized_rows(rows: torch.Tensor, vocab_size: int, pieces: dict[int, list[int]], base_size: int) -> torch.Tensor:
    """``rows`` [old vocab, hidden] as [vocab_size, hidden]: old rows kept, rows of new ids the
    mean of their pieces' rows, added padding rows the mean of the base tokens' rows (in fp32,
    stored in ``rows``' dtype)."""
    resized = torch.empty(vocab_size, rows.shape[1], dtype=rows.dtype)
    resized[:len(rows)] = rows
    if vocab_size > len(rows):
        resized[len(rows):] = rows[:base_size].float().mean(0).to(rows.dtype)
    for token_id, piece_ids in pieces.items():
        resized[token_id] = rows[piece_ids].float().mean(0).to(rows.dtype)
    return resized


def check_pieces(config: ModelConfig, pieces: dict[int, list[int]], base_size: int, vocab_size: int) -> None:
    """CheckpointError unless the base tokenizer fits the model and every new id and piece is a row."""
    if base_size > config.vocab_size:
        raise CheckpointError(f"the base tokenizer has {base_size} ids but the model only {config.vocab_size} rows, so "
                              "it is not the model's tokenizer; pass the one it was trained with as --base-tokenizer.")
    for token_id, piece_ids in pieces.items():
        if not piece_ids or not 0 <= min(piece_ids) <= max(piece_ids) < base_size or token_id >= vocab_size:
            raise CheckpointError(f"new token id {token_id} (pieces {piece_ids}) does not fit the base tokenizer's "
                                  f"{base_size} ids; build the new tokenizer with `meshlm tokenizer extend`.")


def vocab_plan(config: ModelConfig, stored: dict[str, tuple], read: Callable[[str], torch.Tensor],
               pieces: dict[int, list[int]], base_size: int,
               pad_to_multiple: int | None = None) -> tuple[ModelConfig, dict[str, PlannedTensor]]:
    """(adapted config, plan of its tensors, each in its stored dtype) for the model whose tensors
    are ``stored`` ({name: (shape, dtype)}); ``pieces``: {new id: its base ids} (module docstring)."""
    needed = 1 + max([base_size - 1, *pieces])
    adapted = ModelConfig.from_dict({**config.to_dict(),
                                     "vocab_size": new_vocab_size(config.vocab_size, needed, pad_to_multiple)})
    check_pieces(config, pieces, base_size, adapted.vocab_size)
    plan = {}
    for name in expected_shapes(adapted):
        shape, dtype = stored[name]
        if name in VOCAB_TENSORS:
            produce = partial(_resized, read, name, adapted.vocab_size, pieces, base_size)
            plan[name] = PlannedTensor((adapted.vocab_size, *shape[1:]), dtype, produce)
        else:
            plan[name] = PlannedTensor(tuple(shape), dtype, partial(read, name))
    return adapted, plan


@torch.no_grad()
def adapt_vocab_model(model: LanguageModel, pieces: dict[int, list[int]], base_size: int,
                      pad_to_multiple: int | None = None) -> LanguageModel:
    """The model with its vocabulary resized to hold ``pieces``' new ids, in memory."""
    state = {name: value.detach() for name, value in model.state_dict().items()}
    stored = {name: (tuple(value.shape), value.dtype) for name, value in state.items()}
    config, plan = vocab_plan(model.config, stored, state.__getitem__, pieces, base_size, pad_to_multiple)
    with torch.device("meta"):
        adapted = LanguageModel(config)
    load_state_checked(adapted, {name: entry.produce() for name, entry in plan.items()}, "the adapted state")
    return adapted


def _resized(read: Callable[[str], torch.Tensor], name: str, vocab_size: int, pieces: dict[int, list[int]],
             base_size: int) -> torch.Tensor:
    return resized_rows(read(name), vocab_size, pieces, base_size)


__all__ = ["PAD_MULTIPLE", "VOCAB_TENSORS", "adapt_vocab_model", "check_pieces", "new_vocab_size", "resized_rows",
           "vocab_plan"]
