"""The model an evaluation runs: its weights on this rank, its tokenizer, its layout, its length.

One process evaluates the whole model. Under torchrun the world is split into data-parallel
ranks (each scores its share of the windows or answers; the sums are added over them) and, with
``tp > 1``, tensor-parallel groups of ``tp`` adjacent ranks that hold one copy of the model
between them. The model is built as training builds it (``meshlm/training/build.py``): on
``meta``, cut to this rank's tensor-parallel slices by ``parallelize_model``, and only then
filled, so a rank reads its own slices of the file or checkpoint, never the whole model. The
head gathers the full logits (``TensorParallelLanguageModel.head_logits``), so every rank of a
group sees the same log-probabilities as one process would. Pipeline, context and expert
parallelism are training layouts and are not offered here: a model that fits in a few GPUs is
evaluated with tensor and data parallelism.

The default window length is the one the model was trained with: a training checkpoint records
its run's ``train.seq_len`` in ``config.json``; a converted Hugging Face model its
``max_position_embeddings``; otherwise 1024 (``checkpoint.model_files.trained_seq_len``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from meshlm.checkpoint.locate import resolve_model_dir
from meshlm.checkpoint.materialize import materialize
from meshlm.checkpoint.model_files import (check_stored_tensors, read_model_config, source_file, trained_seq_len,
                                           weights_source)
from meshlm.config import ParallelConfig
from meshlm.data.tokenizer import Tokenizer
from meshlm.errors import ConfigError
from meshlm.inference.cli import find_tokenizer
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel
from meshlm.parallel.mesh import ParallelContext, build_parallel_context
from meshlm.parallel.parallelize import parallelize_model

"""Window length when the model folder records neither a training seq_len nor a maximum position."""


@dataclass
class EvaluationModel:
    model: LanguageModel
    """This rank's share of the model (the whole model with tp 1), in eval mode."""
    tokenizer: Tokenizer | None
    """``--tokenizer``, else the one saved with the model or run; None when there is none."""
    directory: Path
    """The model folder or ``step_N`` checkpoint the weights came from."""
    context: ParallelContext
    """The layout: data-parallel ranks split the work, a tensor-parallel group shares the model."""
    default_seq_len: int
    """The window length the model was trained with (see the module docstring)."""

    @property
    def device(self) -> torch.device:
        return self.context.device

    @property
    def work_group(self):
        """The ranks that split the work between them (None in one process)."""
        return self.context.dp_group

    @property
    def work_rank(self) -> tuple[int, int]:
        """(this rank's index among the ranks that split the work, how many there are)."""
        return self.context.dp_rank, self.context.dp_size


def default_device() -> torch.device:
    """cuda (this process's GPU under torchrun) when there is one, else cpu."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")



def evaluation_context(config: ModelConfig, device: torch.device, tp: int) -> ParallelContext:
    """One process: no groups. Under torchrun: the world as data-parallel x ``tp`` (checked)."""
    if isinstance(tp, bool) or tp < 1:
        raise ConfigError(f"--tp {tp} must be a number of ranks >= 1.")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if torch.distributed.is_initialized():
        world_size = torch.distributed.get_world_size()
    if world_size % tp:
        raise ConfigError(f"--tp {tp} does not divide the {world_size} processes started; launch a multiple of "
                          f"{tp} processes with torchrun (--nproc_per_node), or lower --tp.")
    if world_size == 1:
        return ParallelContext(device=device)
    return build_parallel_context(ParallelConfig(tp=tp), config, device)


def load_for_layout(model_dir: Path, context: ParallelContext) -> LanguageModel:
    """This rank's share of the model in ``model_dir``: built on meta, cut to the layout, then
    filled from the file (or shards) one tensor at a time, in the dtypes they were saved in."""
    config = read_model_config(model_dir)
    source = weights_source(model_dir)
    check_stored_tensors(config, source.layout, str(source_file(model_dir)))
    with torch.device("meta"):
        model = LanguageModel(config)
    model = parallelize_model(model, context)
    dtypes = {name: dtype for name, (_, dtype) in source.layout.items()}
    return materialize(model, context, source, context.device, dtype=dtypes).eval()


def load_for_evaluation(checkpoint: str | os.PathLike, tokenizer: str | None = None,
                        device: str | torch.device | None = None, tp: int = 1) -> EvaluationModel:
    """Resolve ``checkpoint`` (model folder, checkpoint or run), build the layout, load the model."""
    model_dir = resolve_model_dir(checkpoint)
    device = default_device() if device is None else torch.device(device)
    context = evaluation_context(read_model_config(model_dir), device, tp)
    model = load_for_layout(model_dir, context)
    return EvaluationModel(model=model, tokenizer=find_tokenizer(tokenizer, model_dir, Path(checkpoint)),
                           directory=model_dir, context=context, default_seq_len=trained_seq_len(model_dir))


__all__ = ["EvaluationModel", "default_device", "evaluation_context", "load_for_evaluation",
           "load_for_layout"]
